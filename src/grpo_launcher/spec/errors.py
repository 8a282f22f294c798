"""Config violations: every problem names its dotted key(s), shows the arithmetic, and says the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Violation:
    rule: str  # short rule name, e.g. "rollout_batch_divisible_by_gbs"
    keys: tuple[str, ...]  # dotted keys involved, most relevant first
    message: str  # what is wrong, with the arithmetic
    fix: str  # what to change

    def render(self) -> str:
        return f"  - {', '.join(self.keys)}: {self.message}\n      fix: {self.fix}   [rule: {self.rule}]"


class ConfigError(Exception):
    """Raised with ALL violations at once; launch.py prints it and exits 2, without a traceback."""

    def __init__(self, violations: list[Violation], partial: Any = None):
        super().__init__(f"{len(violations)} config violation(s)")
        self.violations = list(violations)
        self.partial = partial  # the config composed without the bad overrides, so rules can still run

    def render(self) -> str:
        n = len(self.violations)
        head = f"config error: {n} problem{'s' if n != 1 else ''} found before anything was started"
        return "\n".join([head, *(v.render() for v in self.violations)])
