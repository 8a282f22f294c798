"""The rule registry: a rule is a function `spec -> Iterable[Violation]` registered with `@rule(kind)`.

Pre-flight's own rules (preflight/*.py, a theme each) and each room's (ROOM/rules.py: envs/, gym/, policy/,
tracking/) register here when imported; preflight/validate.py imports every one of them, in the order of its
RULE_MODULES, and runs them. This module imports only the spec's vocabulary, so a room's rules can import it from
below. Each violation names the dotted key(s), shows the arithmetic, and says the fix. A rule's kind:
  pure   the spec and what it names (data, reward code, model config): every validation runs it, a dry run too;
  probe  what only a real launch from here needs (this machine's GPUs and paths, a reachable cluster, this build's
         backends, the run dir's checkpoints): a dry run skips it, so a plan for another cluster or build renders.
Sources: NeMo-RL's 35 late-firing rules and its gap table, verl's batch rules, and the seed recipe's two review bugs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Literal

from ..spec.errors import Violation
from ..spec.schema import RunSpec

Kind = Literal["pure", "probe"]
Check = Callable[[RunSpec], Iterable[Violation]]


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str  # what its violations are named
    kind: Kind
    check: Check


RULES: dict[str, Rule] = {}  # by check function; a rule checked in two kinds or rooms has a check for each


def rule(kind: Kind, name: str | None = None) -> Callable[[Check], Check]:
    """Register a check as rule `name` (default: the function's name)."""
    def register(fn: Check) -> Check:
        if fn.__name__ in RULES:
            raise ValueError(f"two checks named {fn.__name__}")
        RULES[fn.__name__] = Rule(name or fn.__name__, kind, fn)
        return fn
    return register


def V(name: str, keys: str | tuple[str, ...], message: str, fix: str) -> Violation:  # noqa: N802
    return Violation(name, (keys,) if isinstance(keys, str) else keys, message, fix)


def build_gap(keys: tuple[str, ...], what: str, fix: str) -> Violation:
    """A violation of build_implements_run: a part of the spec this build cannot run (a probe in every room)."""
    return V("build_implements_run", keys, what, f"{fix}; dry_run=true still shows the plan")
