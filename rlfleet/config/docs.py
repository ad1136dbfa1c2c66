"""The reference of docs/configuration.md, generated from the schema: every key of the embedded default with its
default and its comment (``rlfleet.config.schema``), one table per config group.

    python -m rlfleet.config.docs --write   # rewrite the block between the markers in docs/configuration.md
    python -m rlfleet.config.docs --check   # exit 1 when the page is out of step with the schema

The page's hand-written prose stays as it is: only the lines between ``BEGIN`` and ``END`` are generated.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from rlfleet.config.schema import SchemaKey, schema_keys

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN = "<!-- BEGIN generated reference: python -m rlfleet.config.docs --write -->"
END = "<!-- END generated reference -->"
FIX = "python -m rlfleet.config.docs --write"


def _default(value) -> str:
    """A default as the YAML would give it, in code style."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value, separators=(", ", ": ")).replace('"', "")
    else:
        text = str(value)
    return f"`{text}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference(keys: tuple[SchemaKey, ...] | None = None) -> str:
    """The generated block's text (without the markers): one table per group that holds values."""
    keys = schema_keys() if keys is None else keys
    groups: dict[str, list[SchemaKey]] = {}
    notes: dict[str, str] = {}
    for key in keys:
        if key.group:
            notes[key.path] = key.comment
            continue
        parent = key.path.rsplit(".", 1)[0] if "." in key.path else ""
        groups.setdefault(parent, []).append(key)
    out = [
        f"{sum(len(v) for v in groups.values())} keys, generated from the comments of "
        "[`rlfleet/configs/pandapickcube_ppo.yaml`](../rlfleet/configs/pandapickcube_ppo.yaml) "
        f"(`{FIX}`; a test fails when this block is out of step).",
        "",
    ]
    for group, items in groups.items():
        out.append(f"#### `{group}`")
        out.append("")
        if notes.get(group):
            out += [_cell(notes[group]), ""]
        out += ["| key | default | meaning |", "|---|---|---|"]
        out += [f"| `{k.path}` | {_cell(_default(k.default))} | {_cell(k.comment)} |" for k in items]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def render(page_text: str) -> str:
    """``page_text`` with its generated block replaced by the current reference."""
    if BEGIN not in page_text or END not in page_text:
        raise ValueError(f"{PAGE.name}: the markers of the generated reference are missing ({BEGIN} ... {END})")
    head, rest = page_text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{reference()}\n{END}{tail}"


def stale(page: pathlib.Path = PAGE) -> bool:
    text = page.read_text()
    return render(text) != text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.config.docs", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite the generated block of {PAGE.name}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page is out of step with the schema")
    args = parser.parse_args(argv)
    if args.write:
        text = PAGE.read_text()
        new = render(text)
        if new != text:
            PAGE.write_text(new)
        print(f"{PAGE}: {'rewritten' if new != text else 'already in step'}")
        return 0
    if args.check:
        if stale():
            print(f"{PAGE}: the reference is out of step with the schema; run `{FIX}`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
