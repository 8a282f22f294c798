"""Imports flow one way: launch → train/preflight → policy/rollout/envs/gym → algos/spec/tracking → package level
→ the vocabulary (spec/schema.py, spec/errors.py, and preflight/registry.py, through which every room registers its
rules). Every import in src/grpo_launcher (module level and inside functions, read with ast) may name its own layer
or one below; ALLOWED lists the few that go up, each with its reason (a stale entry fails too, so the list only
shrinks)."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

SRC = ROOT / "src"
PKG = "grpo_launcher"

# the lower the number, the lower the layer; a module imports its own layer or lower
LAYERS = {"launch": 5, "train": 4, "preflight": 4, "policy": 3, "rollout": 3, "envs": 3, "gym": 3,
          "algos": 2, "spec": 2, "tracking": 2, "models": 2, "checkpoint": 1}
PACKAGE_LEVEL = 1  # batch.py, plan.py, secrets.py, runfiles.py, exit_codes.py, ...; checkpoint/ is a run-dir store
VOCABULARY = {"spec.schema", "spec.errors", "preflight.registry"}  # what every layer is typed and ruled by: layer 0

ALLOWED = {
    ("gym.env", "train.gym_loop"): "the env names its loop's rollout source (rollout_source), imported only when asked",
    ("rollout.vllm", "preflight.memory_estimate"): "a GPU engine's KV cache is the memory model's budget "
                                                   "(kv_cache_bytes): one formula predicts and allocates it",
    ("runfiles", "spec.compose"): "load_spec_file reads spec.yaml back through the spec's own composition",
    ("spec.compose", "preflight.validate"): "load_spec validates the spec it composed (imported inside checked_spec: "
                                            "compose is also the job's reader of spec.yaml)",
    ("spec.resolve", "envs.preflight"): "env.max_prompt_tokens=0 resolves from the env room's one read of the data",
    ("tracking.records", "envs.base"): "type annotation only (TYPE_CHECKING)",
    ("tracking.report", "envs.prompting"): "the run's prompting record comes from the env's prompt builder",
    ("tracking.repro", "envs.rewards"): "the user's reward files are recorded to reproduce the run",
    ("tracking.repro", "envs.usercode"): "the user's reward files are recorded to reproduce the run",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = SRC.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imported(path: Path):
    """(line, module) for every grpo_launcher module this file imports, relative imports resolved."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from . import rundir` names a module; `from .x import f` names x
            names = [f"{mod}.{a.name}" if is_module(f"{mod}.{a.name}") else mod for a in node.names]
        else:
            continue
        for name in names:
            if name == PKG or name.startswith(PKG + "."):
                yield node.lineno, name


def short(name: str) -> str:
    return name[len(PKG) + 1:] if name.startswith(PKG + ".") else ""


def layer(name: str) -> int:
    s = short(name)
    if s in VOCABULARY or any(s.startswith(v + ".") for v in VOCABULARY):
        return 0
    top = s.split(".")[0]
    if top in LAYERS:
        return LAYERS[top]
    assert s == "" or "." not in s, f"{name}: a new subpackage needs its layer in LAYERS"
    return PACKAGE_LEVEL


def upward_imports() -> dict[tuple[str, str], str]:
    found = {}
    for path in sorted((SRC / PKG).rglob("*.py")):
        me = module_name(path)
        for line, target in imported(path):
            if layer(target) > layer(me):
                found[(short(me), short(target))] = f"{path.relative_to(ROOT)}:{line}"
    return found


def test_every_subpackage_has_a_layer():
    for d in sorted((SRC / PKG).iterdir()):
        if (d / "__init__.py").is_file() or (d.is_dir() and any(d.glob("*.py"))):
            assert d.name in LAYERS, f"src/{PKG}/{d.name}/ has no layer in LAYERS"


def test_imports_flow_one_way():
    found = upward_imports()
    up = {k: where for k, where in found.items() if k not in ALLOWED}
    assert not up, "upward imports (a module imports a layer above its own):\n" + "\n".join(
        f"  {where}: {a} imports {b}" for (a, b), where in sorted(up.items()))
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"ALLOWED entries no longer needed (remove them): {stale}"


def test_the_walk_sees_lazy_relative_imports():
    """An import inside a function, relative, is found and resolved; the layers order as the docstring says."""
    names = {t for _, t in imported(SRC / PKG / "spec" / "compose.py")}
    assert f"{PKG}.spec.resolve" in names and f"{PKG}.preflight.validate" in names  # both inside checked_spec
    assert layer(f"{PKG}.launch.preflight") > layer(f"{PKG}.preflight.validate") > layer(f"{PKG}.envs.rules") > \
        layer(f"{PKG}.plan") > layer(f"{PKG}.spec.schema") == layer(f"{PKG}.preflight.registry")


def test_room_rules_are_listed_where_the_import_graph_shows_them():
    """Every ROOM/rules.py is imported by preflight/validate.py and listed in its RULE_MODULES (no file is found by
    a glob); every module that registers a rule is listed; the rooms register through preflight/registry.py, which
    imports only the vocabulary."""
    from grpo_launcher.preflight.validate import RULE_MODULES, registered

    listed = {m.__name__ for m in RULE_MODULES}
    rooms = {f"{PKG}.{p.parent.name}.rules" for p in (SRC / PKG).glob("*/rules.py")}
    assert rooms and rooms <= listed <= {t for _, t in imported(SRC / PKG / "preflight" / "validate.py")}
    assert {r.check.__module__ for r in registered().values()} == listed
    assert not [t for _, t in imported(SRC / PKG / "preflight" / "registry.py") if layer(t) > 0]



# Packages of one layer may import each other one way only: with the upward imports (ALLOWED) left out, the import
# graph between packages has no cycle but these, each with its reason (a stale entry fails too).
PACKAGE_CYCLES: dict[frozenset[str], str] = {}


def package_of(name: str) -> str:
    """The node of the package graph: a subpackage (spec, tracking, ...), a package-level module, or the vocabulary."""
    s = short(name)
    return "vocabulary" if layer(name) == 0 else s.split(".")[0]


def package_cycles() -> set[frozenset[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted((SRC / PKG).rglob("*.py")):
        me = module_name(path)
        for _, target in imported(path):
            if (short(me), short(target)) not in ALLOWED and package_of(target) != package_of(me):
                graph.setdefault(package_of(me), set()).add(package_of(target))
    return strongly_connected(graph)


def test_packages_of_one_layer_import_one_way():
    """spec/ and tracking/ imported each other (MLflow's variables: spec/mlflow_env.py now), and gym/ and rollout/ did
    (the Gym probe, which wires an engine to Gym's servers: train/gym_probe.py now)."""
    cycles = package_cycles()
    assert cycles <= set(PACKAGE_CYCLES), f"import cycles between packages: {sorted(map(sorted, cycles))}"
    assert set(PACKAGE_CYCLES) <= cycles, f"PACKAGE_CYCLES entries no longer needed: {set(PACKAGE_CYCLES) - cycles}"

# Import cycles among launch/'s modules (imports inside functions counted): none but these, each with its reason.
LAUNCH_CYCLES = {
    frozenset({"launch.rundir", "launch.status"}): "the run lock asks Slurm whether its holder still runs (status.py) "
    "and a job's end releases it (rundir.py); both import inside functions: `python -m grpo_launcher.launch.status` "
    "(job.sh) must not find status loaded by the package",
}


def import_cycles(package: str) -> set[frozenset[str]]:
    """The strongly connected components (more than one module) of the import graph among `package`'s modules."""
    graph = {short(module_name(p)): {short(t) for _, t in imported(p)}
             for p in sorted((SRC / PKG / package).rglob("*.py"))}
    return strongly_connected({v: ws & graph.keys() for v, ws in graph.items()})


def strongly_connected(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, set())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_launch_has_no_import_cycles():
    """launch/ imports one way: the door (app.py, sweep.py) → execute (__init__.py) → the executors (local.py,
    slurm.py) → pre-flight (preflight.py) → the run dir, the job script and the saved spec (rundir.py, sbatch.py,
    repro.py)."""
    cycles = import_cycles("launch")
    assert cycles <= set(LAUNCH_CYCLES), f"import cycles in launch/: {sorted(map(sorted, cycles - set(LAUNCH_CYCLES)))}"
    assert set(LAUNCH_CYCLES) <= cycles, f"LAUNCH_CYCLES entries no longer needed: {set(LAUNCH_CYCLES) - cycles}"
