"""The shape of the code (docs/architecture.md): rlfleet's layers import only lower layers, no shared module names
env-side code (by import or by string), the services never import each other, the coordinator process never
loads a simulator backend, and no first-party module imports itself back through others (no import circles)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {
    "registry": 0,
    "untrusted": 0,
    "errors": 0,
    "v1": 1,
    "wire": 1,
    "data": 2,
    "simulators": 3,
    "policies": 4,
    "algorithms": 4,
    "config": 5,
    "configs": 5,
}


def _modules(folder: pathlib.Path):
    for path in sorted(folder.rglob("*.py")):
        if "v1" in path.relative_to(ROOT).parts[:2]:
            continue  # generated
        yield path, ast.parse(path.read_text(), str(path))


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if parts[0] == "rlfleet" and len(parts) > 1 else None


def test_each_layer_imports_only_lower_layers():
    wrong = []
    for path, tree in _modules(ROOT / "rlfleet"):
        rel = path.relative_to(ROOT)
        own = LAYERS[rel.parts[1].removesuffix(".py")] if len(rel.parts) > 2 or rel.stem != "__init__" else -1
        for module in _imports(tree):
            if module.startswith("services"):
                wrong.append(f"{rel} imports {module}")
            layer = _layer(module)
            if layer is not None and own >= 0 and layer > own:
                wrong.append(f"{rel} (layer {own}) imports {module} (layer {layer})")
    assert not wrong, "\n".join(wrong)


def test_no_shared_module_names_env_side_code():
    """Not in an import, not in a string (a "module:Class" reference, a command line, a docstring)."""
    wrong = []
    for path, tree in _modules(ROOT / "rlfleet"):
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and ("services.env" in node.value or "services/env" in node.value)
            ):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.strip()[:80]!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("service", ["env", "inference", "learner", "coordinator"])
def test_services_never_import_each_other(service):
    wrong = []
    for path, tree in _modules(ROOT / "services" / service):
        for module in _imports(tree):
            if module.startswith("services.") and not module.startswith(f"services.{service}"):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


# A service's transport modules are the ones whose job is gRPC: its face (each server.py translates calls into calls
# on its core), its clients of peers that the core calls through, and the command line that sets up a process's
# transport (credentials, TLS) and reports failed calls. Everything else in services/ is core: it raises
# rlfleet.errors types (a server.py maps them to status codes through rlfleet.wire.status) and never imports gRPC,
# the generated stubs or rlfleet.wire's gRPC machinery (GRPC_WIRE) itself.
TRANSPORT = {
    "services/coordinator/server.py",
    "services/env/server.py",
    "services/inference/server.py",
    "services/learner/server.py",
    "services/coordinator/calls.py",  # the coordinator's calls into the fleet (and external env servers' Describe)
    "services/coordinator/cli.py",  # coordinatorctl: a client of the coordinator, the process's TLS
    "services/coordinator/offline_eval.py",  # coordinatorctl eval: the process's TLS, failed calls reported
    "services/env/remote.py",  # the bridge to an external simulator's EnvService
    "services/learner/publisher.py",  # weights to the inference servers
}
# rlfleet.wire's gRPC machinery (the typed clients in rlfleet.wire.clients, which raise rlfleet.errors, are not)
GRPC_WIRE = {
    "rlfleet.wire.channels",
    "rlfleet.wire.servers",
    "rlfleet.wire.status",
    "rlfleet.wire.streams",
    "rlfleet.wire.tls",
}


def _transport_imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        for name in names:
            top = name.split(".")[0]
            if (
                top == "grpc"
                or top.startswith("grpc_")
                or name in GRPC_WIRE
                or (name.startswith("rlfleet.v1.") and name.endswith("_grpc"))
            ):
                out.append(f"{name} (line {node.lineno})")
    return out


def test_no_service_core_imports_grpc():
    """Only the transport modules (TRANSPORT) import gRPC or rlfleet.wire's gRPC machinery; a core that needs a
    call's status code, a channel or a server gets it through its service's transport module."""
    cores = [p for p in sorted((ROOT / "services").rglob("*.py")) if str(p.relative_to(ROOT)) not in TRANSPORT]
    assert len(cores) > 30 and all((ROOT / t).is_file() for t in TRANSPORT)
    wrong = [f"{p.relative_to(ROOT)} imports {m}" for p in cores for m in _transport_imports(ast.parse(p.read_text()))]
    assert not wrong, "\n".join(wrong)
    # and the check sees what it is meant to see
    assert _transport_imports(ast.parse("import grpc\nfrom rlfleet.wire import servers, codec")) == [
        "grpc (line 1)",
        "rlfleet.wire.servers (line 2)",
    ]


COORDINATOR_PREPARES = r"""
import json, sys
from rlfleet.config import ConfigError, load_config
from rlfleet.simulators import SIMULATORS
from services.coordinator.preflight import preflight_local
from services.coordinator.launcher import simulator_python
out = {}
for name, config in [("gym", "pandapickcube_ppo"), ("metaworld", "metaworld_mt10_ppo_mlp"),
                     ("libero", "libero_spatial_ppo_cnn"), ("maniskill", "maniskill_pushcube_ppo_mlp"),
                     ("behavior", "behavior_ppo_cnn")]:
    try:
        preflight_local(load_config(config, []))
        out[name] = "ok"
    except ConfigError as exc:
        out[name] = str(exc)[:200]
assert set(out) == set(SIMULATORS), out
loaded = sorted(m for m in sys.modules if m.startswith("services.env") or m.split(".")[0] in
                ("metaworld", "mani_skill", "sapien", "robosuite", "libero", "omnigibson"))
print(json.dumps({"preflight": out, "loaded": loaded}))
"""


def test_the_coordinator_never_loads_env_code_for_any_simulator():
    """The coordinator's preflight of every built-in simulator (what `coordinatorctl start` checks before anything
    runs) asks the env side in a subprocess: its own process loads no env-side module and no simulator package."""
    import json

    proc = subprocess.run(
        [sys.executable, "-c", COORDINATOR_PREPARES], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [], result
    assert all(result["preflight"][s] == "ok" for s in ("gym", "metaworld", "libero", "maniskill")), result
    # behavior needs an RTX GPU this machine lacks: the env side's preflight says so (the coordinator relays it)
    assert "behavior cannot run on this machine" in result["preflight"]["behavior"], result


def test_every_simulator_has_its_env_side_entry_and_nothing_else():
    """The shared registry (data) and the env side's table (code) name the same simulators."""
    from rlfleet.simulators import SIMULATORS
    from services.env.backends import FINISH_STEPS, PREFLIGHTS, SIM_BACKENDS

    assert set(SIM_BACKENDS) == set(SIMULATORS)
    assert set(PREFLIGHTS) <= set(SIMULATORS) and set(FINISH_STEPS) <= set(SIMULATORS)


# --- import circles -----------------------------------------------------------------------------------------------
def _first_party() -> dict[str, pathlib.Path]:
    """Every first-party module by its dotted name (a package by its ``__init__``), the generated rlfleet/v1 left out."""
    out = {}
    for top in ("rlfleet", "services"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[:2] == ("rlfleet", "v1"):
                continue
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _module_edges(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> list[tuple[str, int]]:
    """(first-party module imported, line) for every import statement of the file, wherever it is: at the top, in a
    function (lazy), under ``if TYPE_CHECKING:``. ``from pkg import x`` goes to the submodule ``pkg.x`` when there is
    one, else to ``pkg`` itself; a relative import is resolved against the file's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def owner(module: str) -> str | None:  # the module itself, or the first-party module that defines the name
        while module and module not in known:
            module = module.rpartition(".")[0]
        return module or None

    edges = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [owner(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [
                owner(f"{module}.{a.name}") if f"{module}.{a.name}" in known else owner(module) for a in node.names
            ]
        else:
            continue
        edges += [(t, node.lineno) for t in targets if t is not None and t != name]
    return edges


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles():
    """No two first-party modules (rlfleet/ and services/, generated rlfleet/v1 aside) import each other, directly or
    through others. Every import statement counts, wherever it is in the file: at the top, inside a function (a lazy
    import still makes the two modules depend on each other) and under ``if TYPE_CHECKING:`` (a type is a
    dependency too). ``from pkg import x`` is an edge to the submodule ``pkg.x`` when there is one, else to ``pkg``;
    relative imports are resolved.

    Packages: an edge is what a file imports by name, so a submodule that imports its package (``import pkg``, or a
    name that ``pkg/__init__.py`` defines) depends on the ``__init__``. The parent packages that Python runs first
    when any submodule is imported are no edge: that order is the interpreter's, not a dependency the code chose. So a
    package ``__init__`` that re-exports its submodules is fine as long as none of them imports the ``__init__``
    back; one that does is a circle (the submodule would run against a half-initialised package).

    A circle is fixed by moving the shared piece down a layer (to a module both import), never by hiding an import.
    Self-imports are ignored."""
    known = _first_party()
    graph: dict[str, set[str]] = {name: set() for name in known}
    lines: dict[tuple[str, str], int] = {}
    for name, path in known.items():
        for target, line in _module_edges(name, path, known):
            graph[name].add(target)
            lines.setdefault((name, target), line)
    report = []
    for component in _circles(graph):
        members = set(component)
        imports = [
            f"    {known[a].relative_to(ROOT)}:{lines[a, b]} imports {b}"
            for a in component
            for b in sorted(graph[a] & members)
        ]
        report.append(f"circle of {len(component)}: {', '.join(component)}\n" + "\n".join(imports))
    assert not report, "import circles:\n" + "\n".join(report)
