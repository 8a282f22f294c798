"""Pieces of the commands the launcher prints for the user to paste (resume, rerun, export, `mlflow ui`): each one
passes a POSIX shell intact, and an override reads back through Hydra and OmegaConf as exactly the value it names.

    override("output_root", "/tmp/out sp/ü")  →  'output_root="/tmp/out sp/ü"'
    override("name", "foo")                   →  name=foo          (the common case stays as typed)
    arg(Path("/tmp/out sp/run"))              →  '/tmp/out sp/run'
"""

from __future__ import annotations

import re
import shlex
from functools import lru_cache

# a plain value Hydra reads as itself: its grammar's ID characters, digits and the unquoted characters it allows
# (OverrideLexer.g4 UNQUOTED_CHAR), less '$' (an interpolation) and '\\' (an escape)
_PLAIN = re.compile(r"[A-Za-z0-9_./+%@-]+")
_BEFORE_INTERPOLATION = re.compile(r"(\\*)\$\{")  # OmegaConf: `\${` is a literal `${`, `\\` a backslash before it
_BEFORE_QUOTE = re.compile(r'(\\*)"')  # Hydra's quoted value: `\"` is a quote, `\\` a backslash before one
_TRAILING_BACKSLASHES = re.compile(r"(\\+)$")


def arg(value: object) -> str:
    """A plain argument (a path, a URI, a run name): shell-quoted when it needs to be."""
    return shlex.quote(str(value))


def override(key: str, value: str) -> str:
    """`key=value` as one shell word that Hydra's override grammar reads back as exactly `value` (a string)."""
    return shlex.quote(f"{key}={hydra_value(value)}")


def hydra_value(value: str) -> str:
    """`value` as Hydra's override grammar writes a string: as is when it reads back unchanged, else double-quoted
    with Hydra's escapes (a quote, and backslashes before a quote or the closing one) and OmegaConf's (`${`)."""
    if _PLAIN.fullmatch(value) and _reads_as_itself(value):
        return value
    text = _BEFORE_INTERPOLATION.sub(lambda m: m[1] * 2 + "\\${", value)
    text = _BEFORE_QUOTE.sub(lambda m: m[1] * 2 + '\\"', text)
    return '"' + _TRAILING_BACKSLASHES.sub(lambda m: m[1] * 2, text) + '"'


@lru_cache(maxsize=256)
def _reads_as_itself(value: str) -> bool:
    """Hydra parses `k=value` as this very string (not an int, float, bool, null, list or sweep)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # here: Hydra's parser is slow to build

    try:
        return OverridesParser.create().parse_override(f"k={value}").value() == value
    except Exception:  # noqa: BLE001 - anything Hydra refuses unquoted is quoted
        return False
