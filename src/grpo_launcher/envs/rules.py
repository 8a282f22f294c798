"""The env room's pre-flight rule (preflight/validate.py lists this module in RULE_MODULES)."""

from __future__ import annotations

from typing import Iterator

from ..spec.errors import Violation
from ..preflight.registry import rule
from ..spec.schema import RunSpec
from .preflight import check_env


@rule("pure")
def env_data_and_code(s: RunSpec) -> Iterator[Violation]:
    """What the user brings to the env section: Env class, data files (keys, rows, lines), reward functions
    (importable, callable, signature), prompt lengths under the chat template. See envs/preflight.py."""
    yield from check_env(s)
