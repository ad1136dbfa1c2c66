"""The commands and links shown in README.md and docs/*.md work.

Every line of every fenced ```bash block is one command (continuation lines joined, comments dropped). Each is sorted
by the first rule of RULES that matches it, and every rule says what the test does with its lines:

  run       the line itself runs and must exit 0 (``--help`` lines, ``coordinatorctl envs``, ``coordinatorctl deploy``
            into a temporary folder in place of its ``--out``);
  config    a ``coordinatorctl start|collect-demos|sft`` line: its config and overrides are loaded with
            ``rlfleet.config.load_config`` (no ConfigError) instead of starting anything;
  help      the line cannot run cheaply (a real run, a live server, building an environment), so the ``--help`` of
            its command runs instead and must exit 0, every ``--option`` the line uses must be in that help, and a
            script's ``--config NAME`` and ``key=value`` overrides must load;
  skip      nothing cheap can check it (the test suite itself, Docker, a GPU, kubectl): skipped by a named rule.

A line no rule matches fails ``test_every_command_line_is_classified``: a new command in the docs is either checked
or consciously skipped by adding a rule here. Links: every relative link (and ``#anchor``) in those files resolves.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest

from rlfleet.config import ConfigError, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASH_LANGS = {"bash", "sh", "shell"}
TIMEOUT_S = 120


# ---------------------------------------------------------------------------------------------------- extraction
@dataclass(frozen=True)
class Command:
    page: str  # path relative to the repository root
    line: int  # first line of the command in the page
    text: str  # the command as written (continuations joined, comment dropped)
    argv: tuple  # shlex tokens, leading VAR=value assignments removed

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _fences(text: str):
    """(language, first line number, lines) of each fenced code block."""
    lang, start, body = None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip().lower(), n + 1, []
            else:
                yield lang, start, body
                lang = None
        elif lang is not None:
            body.append(line)


def bash_commands(page: pathlib.Path) -> list[Command]:
    out = []
    for lang, start, body in _fences(page.read_text()):
        if lang not in BASH_LANGS:
            continue
        pending, first = "", 0
        for i, line in enumerate(body):
            if not pending:
                first = start + i
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            full, pending = pending + line, ""
            argv = shlex.split(full, comments=True)
            while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # `VAR=1 cmd ...`
                argv = argv[1:]
            if argv:
                text = full.split(" #")[0].strip() if " #" in full else full.strip()
                out.append(Command(str(page.relative_to(ROOT)), first, re.sub(r"\s+", " ", text), tuple(argv)))
    return out


COMMANDS = [c for page in PAGES for c in bash_commands(page)]


# ---------------------------------------------------------------------------------------------------- the rules
def _prog(argv) -> str:
    return pathlib.PurePosixPath(argv[0]).name  # `.venv/bin/python` -> python


def _placeholder(tok: str) -> bool:
    """A synopsis token: [OPTIONAL] parts, a|b alternatives, '...', or an upper-case name (CONFIG, RUN_DIR, N)."""
    if "=" in tok and not tok.startswith("["):
        return False  # key=value, even when its value is a list: cluster.external_env_addresses=[...]
    return (
        tok.startswith("[")
        or tok.endswith("]")
        or "|" in tok
        or tok == "..."
        or re.fullmatch(r"[A-Z][A-Z0-9_:]*", tok) is not None
    )


def is_synopsis(argv) -> bool:
    return any(_placeholder(t) for t in argv[1:])


def _ctl(argv, *subs) -> bool:
    return _prog(argv) == "coordinatorctl" and len(argv) > 1 and argv[1] in subs


def _python_script(argv) -> str | None:
    """'benchmarks/x.py' or 'benchmarks.x' for `python benchmarks/x.py ...` / `python -m benchmarks.x ...`."""
    if _prog(argv) not in ("python", "python3") or len(argv) < 2:
        return None
    if argv[1] == "-m" and len(argv) > 2:
        return argv[2]
    return argv[1] if argv[1].endswith(".py") else None


def _script_in(argv, *prefixes) -> bool:
    script = _python_script(argv)
    return script is not None and script.replace("/", ".").startswith(prefixes)


@dataclass(frozen=True)
class Rule:
    name: str
    action: str  # run | config | help | skip
    matches: object


RULES = [
    Rule(
        "the test suite (scripts/test.sh, pytest): far too long here, and CI runs it",
        "skip",
        lambda a: (a[:2] == ("bash", "scripts/test.sh"))
        or (_prog(a) in ("python", "python3") and a[1:3] == ("-m", "pytest")),
    ),
    Rule(
        "the lint step (scripts/lint.sh): CI runs it before the suite",
        "skip",
        lambda a: a[:2] == ("bash", "scripts/lint.sh"),
    ),
    Rule("a training run (scripts/run.sh)", "skip", lambda a: a[:2] == ("bash", "scripts/run.sh")),
    Rule(
        "needs Docker, a cluster or a GPU (docker, docker-compose, kubectl, compose_e2e.sh, nvidia-smi, gpu_fleet.sh)",
        "skip",
        lambda a: _prog(a) in ("docker", "docker-compose", "kubectl", "helm", "nvidia-smi")
        or (_prog(a) == "bash" and len(a) > 1 and a[1] in ("benchmarks/compose_e2e.sh", "scripts/gpu_fleet.sh")),
    ),
    Rule(
        "downloads a dataset or model from the Hugging Face hub (network, GBs)",
        "skip",
        lambda a: _prog(a) in ("hf", "huggingface-cli") and len(a) > 1 and a[1] == "download",
    ),
    Rule("a --help line", "run", lambda a: a[-1] in ("--help", "-h")),
    Rule(
        "coordinatorctl synopsis (placeholders): the subcommand's --help",
        "help",
        lambda a: _prog(a) == "coordinatorctl" and is_synopsis(a),
    ),
    Rule(
        "coordinatorctl start|collect-demos|sft: the config and overrides load",
        "config",
        lambda a: _ctl(a, "start", "collect-demos", "sft"),
    ),
    Rule(
        "coordinatorctl deploy compose|k8s: written into a temporary folder",
        "run",
        lambda a: _ctl(a, "deploy") and len(a) > 2 and a[2] in ("compose", "k8s"),
    ),
    Rule("coordinatorctl configs (the list)", "run", lambda a: _ctl(a, "configs") and not a[2:]),
    Rule("coordinatorctl envs (the list)", "run", lambda a: _ctl(a, "envs") and a[2:] in ((), ("list",))),
    Rule(
        "coordinatorctl envs install|remove: builds or deletes an environment (network, minutes)",
        "help",
        lambda a: _ctl(a, "envs"),
    ),
    Rule(
        "needs a live run or server (status, stop, scale, traces, check-env)",
        "help",
        lambda a: _ctl(a, "status", "stop", "scale", "traces", "check-env"),
    ),
    Rule(
        "coordinatorctl eval: needs a trained run or model folder and starts its services",
        "help",
        lambda a: _ctl(a, "eval"),
    ),
    Rule(
        "a benchmark: starts real runs or servers and measures for minutes",
        "help",
        lambda a: _script_in(a, "benchmarks."),
    ),
    Rule(
        "a long-running server (examples/, services.*.server)",
        "help",
        lambda a: _script_in(a, "examples.", "services."),
    ),
]


def classify(cmd: Command) -> Rule | None:
    for rule in RULES:
        if rule.matches(cmd.argv):
            return rule
    return None


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 30, [c.text for c in COMMANDS]
    assert any(c.page == "README.md" for c in COMMANDS)


def test_every_command_line_is_classified():
    unclassified = [f"{c.where}: {c.text}" for c in COMMANDS if classify(c) is None]
    assert not unclassified, (
        "command lines in the docs that no rule of tests/test_readme.py covers; "
        "add a rule (checked, or skipped with its reason):\n" + "\n".join(unclassified)
    )


def test_commands_in_other_code_blocks_are_fenced_as_bash():
    """A command written in a ``` block without `bash` would escape these checks."""
    stray = []
    for page in PAGES:
        for lang, start, body in _fences(page.read_text()):
            if lang in BASH_LANGS:
                continue
            for i, line in enumerate(body):
                if re.match(r"(coordinatorctl|python3? |\.venv/bin/|bash scripts/|pip )", line):
                    stray.append(f"{page.relative_to(ROOT)}:{start + i}: {line}")
    assert not stray, "fence these blocks as ```bash:\n" + "\n".join(stray)


# ---------------------------------------------------------------------------------------------------- the checks
def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("MUJOCO_GL", "egl")
    return env


def _exe(argv) -> list[str]:
    prog = _prog(argv)
    if prog == "coordinatorctl":
        ctl = pathlib.Path(sys.executable).parent / "coordinatorctl"
        head = [str(ctl)] if ctl.exists() else [sys.executable, "-m", "services.coordinator.cli"]
        return head + list(argv[1:])
    if prog in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return list(argv)


def _run(argv) -> subprocess.CompletedProcess:
    return subprocess.run(_exe(argv), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


def _assert_ok(cmd: Command, argv, proc):
    assert proc.returncode == 0, (
        f"{cmd.where}: `{cmd.text}` (ran: {' '.join(argv)}) exited {proc.returncode}\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


def _help_argv(argv) -> tuple:
    """The command's own --help: the coordinatorctl subcommand, or the python script/module."""
    if _prog(argv) == "coordinatorctl":
        return (argv[0], argv[1], "--help")
    script = _python_script(argv)
    return (argv[0], "-m", script, "--help") if argv[1] == "-m" else (argv[0], script, "--help")


def _options(argv) -> list[str]:
    return sorted({m.group(1) for t in argv[1:] for m in [re.match(r"\[?(--[a-z][\w-]*)", t)] if m})


def _check_config(cmd: Command):
    args = list(cmd.argv[2:])
    config, overrides, resume = None, [], None
    while args:
        tok = args.pop(0)
        if tok == "--resume":
            resume = args.pop(0)
        elif tok == "--episodes":
            args.pop(0)
        elif tok.startswith("--"):
            continue  # --quiet
        elif "=" in tok:
            overrides.append(tok)
        elif config is None and resume is None:
            config = tok
        else:
            pytest.fail(f"{cmd.where}: `{cmd.text}`: unexpected argument {tok!r}")
    if config is not None and (ROOT / config).exists():
        config = str(ROOT / config)
    try:
        # --resume loads RUN_DIR/config.yaml, which is not here: its overrides are checked on the default config
        load_config(config, overrides)
    except ConfigError as exc:
        pytest.fail(f"{cmd.where}: `{cmd.text}`: config error: {exc}")


def _check_script_config(cmd: Command):
    argv = list(cmd.argv)
    config = argv[argv.index("--config") + 1] if "--config" in argv else None
    overrides = [t for t in argv[2:] if "=" in t and not t.startswith(("-", "["))]
    if config is None and not overrides:
        return
    try:
        load_config(config, overrides)
    except ConfigError as exc:
        pytest.fail(f"{cmd.where}: `{cmd.text}`: config error: {exc}")


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{c.where}")
def test_command(cmd: Command, tmp_path):
    rule = classify(cmd)
    if rule is None:
        pytest.fail(f"{cmd.where}: `{cmd.text}` matches no rule (test_every_command_line_is_classified)")
    if rule.action == "skip":
        pytest.skip(f"by rule: {rule.name}")
    if rule.action == "config":
        _check_config(cmd)
        return
    if rule.action == "help":
        argv = _help_argv(cmd.argv)
        proc = _run(argv)
        _assert_ok(cmd, argv, proc)
        missing = [o for o in _options(cmd.argv) if not re.search(rf"(?<![\w-]){o}(?![\w-])", proc.stdout)]
        assert not missing, f"{cmd.where}: `{cmd.text}` uses options its --help does not list: {missing}"
        if _prog(cmd.argv) != "coordinatorctl":  # a script's key=value overrides and --config name a real config
            _check_script_config(cmd)
        return
    argv = list(cmd.argv)
    if _ctl(argv, "deploy"):
        if "--out" in argv:
            i = argv.index("--out")
            del argv[i : i + 2]
        argv += ["--out", str(tmp_path / "out")]
    proc = _run(argv)
    _assert_ok(cmd, argv, proc)
    if _ctl(argv, "deploy"):
        written = list((tmp_path / "out").iterdir())
        assert written, f"{cmd.where}: `{cmd.text}` wrote nothing"


# ---------------------------------------------------------------------------------------------------- links
def github_anchor(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = page.read_text()
    in_fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"#{1,6} (.+)", line)):
            base = github_anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: pathlib.Path):
    """(line number, target) of every markdown link outside code."""
    in_fence = False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        prose = re.sub(r"`[^`]*`", "``", line)
        for m in re.finditer(r"\]\(([^)\s]+)\)", prose):
            yield n, m.group(1)


def test_every_link_resolves():
    broken = []
    for page in PAGES:
        for n, target in links(page):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{n}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


# ---------------------------------------------------------------------------------------------------- the README
def test_the_readme_stays_short_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 300, "README.md is for newcomers: move reference text to a page in docs/"
    two = [c.text for c in bash_commands(ROOT / "README.md")]
    assert "bash scripts/run.sh" in two and "bash scripts/test.sh" in two
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command
