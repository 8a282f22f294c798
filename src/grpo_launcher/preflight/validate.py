"""Pre-flight's rule book: the one list of the modules that register rules, and validate(), which runs them all.

RULE_MODULES names every module whose `@rule` checks (preflight/registry.py) validate() runs, in the order it
runs them: pre-flight's own, a theme each, then each room's ROOM/rules.py. A new rule goes into the module of its
theme (or its room's rules.py); a new rules module goes into RULE_MODULES, where the import graph shows it.
"""

from __future__ import annotations

from ..envs import rules as envs_rules
from ..gym import rules as gym_rules
from ..policy import rules as policy_rules
from ..spec.errors import Violation
from ..spec.schema import RunSpec
from ..tracking import rules as tracking_rules
from . import budgets, cluster, engines, paths, run_dir, sizes, slurm, training, values
from .registry import RULES, Rule, V

RULE_MODULES = (
    sizes,  # batch and parallel sizes, model shapes, sequence lengths
    engines,  # what the rollout engines run: vLLM-only switches, the engine's length and KV cache, sampling
    training,  # loss, async GRPO, optimizer, validation and the checkpoint metric
    cluster,  # Ray's object store, cluster=local and cluster=ray
    slurm,  # Slurm's fields, the job's shell values and ports, --time
    paths,  # the run name and the paths a local run reads
    values,  # every leaf value, and what this build runs
    run_dir,  # the run directory: writable, not finished, checkpoints compatible
    budgets,  # GPU memory, checkpoint disk, the engines' health deadlines
    envs_rules, gym_rules, policy_rules, tracking_rules,  # the rooms' own
)


def _in_list_order() -> None:
    """RULES in RULE_MODULES' order (each module's rules as it defines them), whichever module was imported first;
    a module that registers rules but is not listed is an error."""
    rank = {module.__name__: i for i, module in enumerate(RULE_MODULES)}
    unlisted = sorted({r.check.__module__ for r in RULES.values()} - rank.keys())
    if unlisted:
        raise ImportError(f"rules registered by modules missing from {__name__}.RULE_MODULES: {unlisted}")
    ordered = sorted(RULES.items(), key=lambda item: rank[item[1].check.__module__])
    RULES.clear()
    RULES.update(ordered)


_in_list_order()


def registered() -> dict[str, Rule]:
    """Every check: pre-flight's own and every room's, in the order validate() runs them."""
    return RULES


def rule_names() -> set[str]:
    return {r.name for r in RULES.values()}


def validate(spec: RunSpec) -> list[Violation]:
    """Run every rule (a dry run skips the probes); a rule that itself crashes is reported as a violation."""
    out: list[Violation] = []
    crashed: list[Violation] = []
    for r in RULES.values():
        if r.kind == "probe" and spec.dry_run:
            continue
        try:
            out.extend(r.check(spec))
        except Exception as exc:  # values so wrong that the rule's arithmetic fails: the other rules name them
            crashed.append(V(r.name, "<spec>", f"could not evaluate ({type(exc).__name__}: {exc})",
                             "fix the values named by the other problems"))
    return out or crashed  # a crash is shown only when no rule named the key behind it
