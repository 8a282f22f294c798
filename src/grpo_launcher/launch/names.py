"""The run name a launch derives from its overrides (the default name's run finished: launch/preflight.py; a sweep
point: launch/sweep.py): `BASE_key=value,...`, short and readable, never the cause of a refusal.

A path value counts by its last part (`model.path=/tmp/m/Qwen2.5-1.5B` → `model.path=Qwen2.5-1.5B`); a name that
shortened a value or grew past MAX_DERIVED characters is cut there and ends in `-` + 8 hex digits of a hash of
everything it stands for, so that two different override sets never share a name (nor a run dir)."""

from __future__ import annotations

import hashlib
import re
from typing import Sequence

MAX_DERIVED = 80  # well under preflight/paths.py MAX_NAME (200): readable in `launch.py status`, squeue, MLflow
HASH_CHARS = 8
UNSAFE = re.compile(r"[^A-Za-z0-9_.+=,@-]")  # preflight/paths.py SAFE_NAME's complement


def readable(override: str) -> str:
    """One override as a name part: a path value by its last part, unsafe characters as '_'."""
    key, eq, value = override.partition("=")
    bare = value.strip("'\"").rstrip("/")
    if "/" in bare:
        value = bare.rsplit("/", 1)[-1]
    return UNSAFE.sub("_", f"{key}{eq}{value}")


def derived_name(base: str, overrides: Sequence[str]) -> str:
    """`base_override,override...` when that is short and says every value whole, else cut to MAX_DERIVED with a hash
    suffix of the whole (base and overrides)."""
    exact = ",".join(overrides)  # as given: a value with '_' for an unsafe character ('a%b') is not 'a_b'
    name = f"{base}_{','.join(readable(o) for o in overrides)}"
    if name == f"{base}_{exact}" and len(name) <= MAX_DERIVED:
        return name
    digest = hashlib.sha256("\0".join([base, *overrides]).encode()).hexdigest()[:HASH_CHARS]
    return f"{name[: MAX_DERIVED - HASH_CHARS - 1].rstrip('_,.=+-@')}-{digest}"
