"""A key nothing reads does not exist: every schema field has a reader outside spec/ (the code that makes the run
do what the key says), or an explicit reason here that a test holds.

Readers are found statically (ast): an attribute `X.field` where X is a spec section (`spec.train`, `self.spec.
rollout`, an alias `t = spec.train`, a parameter annotated `ModelSpec`, ...), or `getattr(X, "field")`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from grpo_launcher.preflight.validate import registered
from grpo_launcher.spec import schema
from grpo_launcher.spec.schema import RunSpec

SRC = Path(schema.__file__).resolve().parents[1]  # src/grpo_launcher
SECTION_OF_CLASS = {"RunSpec": ""}


def sections(cls: type = RunSpec, prefix: str = "") -> dict[str, type]:
    """{'train': TrainSpec, 'train.moe': MoESpec, ...}; '' is RunSpec itself."""
    out = {prefix.rstrip("."): cls}
    for f in dataclasses.fields(cls):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            out.update(sections(f.default_factory, f"{prefix}{f.name}."))
    return out


SECTIONS = sections()
CLASS_SECTION = {cls.__name__: name for name, cls in SECTIONS.items()}
LEAVES = {f"{sec + '.' if sec else ''}{f.name}" for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)
          if not (isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory))}
SPEC_NAMES = {"spec", "s", "run_spec"}  # names that hold a RunSpec by convention in this code base


def chain(node: ast.AST) -> list[str] | None:
    """`self.spec.train` → ['self', 'spec', 'train']; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


class Readers(ast.NodeVisitor):
    def __init__(self, alias: dict[str, str] | None = None) -> None:
        self.alias: dict[str, str] = dict(alias or {})  # 'self.env_spec' / 't' -> section
        self.loop_names: dict[str, list[str]] = {}  # `for key in ("partition", "account")` -> key: [...]
        self.found: set[str] = set()

    def visit_For(self, node: ast.For) -> None:
        if isinstance(node.target, ast.Name) and isinstance(node.iter, (ast.Tuple, ast.List)):
            names = [e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            self.loop_names[node.target.id] = names
        self.generic_visit(node)

    def section_of(self, parts: list[str]) -> str | None:
        """The section a name/attribute chain denotes, if any."""
        for i in range(len(parts), 0, -1):
            head = ".".join(parts[:i])
            base = self.alias[head] if head in self.alias else "" if head in SPEC_NAMES or head == "self.spec" else None
            if base is None:
                continue
            rest = parts[i:]
            sec = ".".join([base, *rest]).strip(".") if base else ".".join(rest)
            return sec if sec in SECTIONS else None
        return None

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for arg in [*node.args.args, *node.args.kwonlyargs]:
            ann = ast.unparse(arg.annotation) if arg.annotation else ""
            if ann.strip("'\"") in CLASS_SECTION:
                self.alias[arg.arg] = CLASS_SECTION[ann.strip("'\"")]
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
        targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
        for target, value in zip(targets, values):
            t, v = chain(target), chain(value)
            if t and v and (sec := self.section_of(v)) is not None:
                self.alias[".".join(t)] = sec
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parts = chain(node.value)
        if parts and (sec := self.section_of(parts)) is not None:
            self.found.add(f"{sec + '.' if sec else ''}{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            parts, name = chain(node.args[0]), node.args[1]
            names = [name.value] if isinstance(name, ast.Constant) else \
                self.loop_names.get(name.id, []) if isinstance(name, ast.Name) else []
            if parts and (sec := self.section_of(parts)) is not None:
                self.found.update(f"{sec + '.' if sec else ''}{n}" for n in names)
        self.generic_visit(node)


def readers() -> dict[str, list[str]]:
    """{dotted key: [files outside spec/ and preflight/ that read it]}."""
    out: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] in ("spec", "preflight") or path.name == "rules.py":  # ROOM/rules.py too
            continue
        rel = path.relative_to(SRC).parts
        # envs take their section as `spec` (Env(env_spec, seed=...)): there `spec` is the EnvSpec
        visitor = Readers({"spec": "env", "self.spec": "env"} if rel[0] in ("envs", "gym") else None)
        visitor.visit(ast.parse(path.read_text()))
        for key in visitor.found & LEAVES:
            out.setdefault(key, []).append(str(path.relative_to(SRC)))
    return out


# Keys read only by pre-flight, on purpose: {key: rule that reads it}. The rule must exist, name the key, and have a
# failing case in tests/unit/test_spec.py.
PREFLIGHT_ONLY = {
    "dry_run": "build_implements_run",  # also read by the executors (launch/); kept here for the refusal rule
    "cluster.requires_account": "slurm_fields",  # a cluster profile's declaration: its Slurm needs --account
    "cluster.requires_partition": "slurm_fields",
    "cluster.node_gpus": "slurm_node_shape",  # the profile's GPUs per node, checked against the plan
    "train.transformer_engine": "megatron_needs_transformer_engine",  # what the environment provides
    "train.sequence_packing": "build_implements_run",  # the recipes' megatron layout; refused for a real launch
    "model.family": "build_implements_run",  # checked against config.json and the backend's mappings
    "model.tie_word_embeddings": "build_implements_run",  # read from config.json; the tiny builder builds untied
    "env.gym_config_paths": "gym_needs_async_http_vllm",  # NeMo Gym's configs; env=nemo_gym refused until it runs
    "cluster.gpu_memory_gib": "gpu_memory_fits",  # the profile's GPU memory, for the memory pre-flight
    "model.num_experts": "expert_parallelism",  # architecture facts (from config.json with model.path) the rules
    "model.moe_top_k": "megatron_moe",  # check; the workers read the checkpoint's own config
    "train.max_total_sequence_length": "sequence_lengths",  # the bound prompt + generation budgets must fit
    "cluster.untested_versions": "build_implements_run",  # the version gate's override (spec/versions.py)
}
# Labels: recorded (spec.yaml, MLflow params) so a run says which preset it used; nothing else needs them.
LABELS = {"loss.name": "the loss preset (conf/loss/NAME.yaml) a run used"}
# Keys validated here whose reader is the policy/driver code being reworked (owned by the lead): the exact call
# to add. The test fails once a reader exists, so the entry cannot outlive the wiring.
PENDING: dict[str, str] = {}


def test_every_schema_key_has_a_reader_or_a_tested_reason():
    found = readers()
    unread = sorted(LEAVES - set(found) - set(PREFLIGHT_ONLY) - set(PENDING) - set(LABELS))
    assert not unread, f"keys nothing reads (wire them or delete them from schema.py and conf/): {unread}"


@pytest.mark.parametrize("key,rule", sorted(PREFLIGHT_ONLY.items()))
def test_preflight_only_keys_are_read_by_their_rule(key, rule):
    from unit.test_spec import FAILING

    checks = [r.check for r in registered().values() if r.name == rule]
    assert checks, f"no rule {rule}"
    source = "".join(inspect.getsource(inspect.getmodule(check)) for check in checks)  # preflight/ or ROOM/rules.py
    assert key.rsplit(".", 1)[-1] in source, f"rule {rule} does not read {key}"
    assert any(r == rule for _, r, _ in FAILING), f"no failing config for {rule}"


@pytest.mark.parametrize("key", sorted(PENDING))
def test_pending_keys_are_validated_and_not_yet_read(key):
    from unit.test_spec import FAILING

    assert key not in readers(), f"{key} is read now: move it out of PENDING"
    assert any(key in keys for _, _, keys in FAILING), f"{key} has no failing config in tests/unit/test_spec.py"


@pytest.mark.parametrize("key", sorted(LABELS))
def test_labels_are_recorded(key):
    from grpo_launcher.checkpoint.manager import spec_as_dict
    from grpo_launcher.tracking.mlflow_tracker import flat_params

    assert key in flat_params(spec_as_dict(RunSpec()))
