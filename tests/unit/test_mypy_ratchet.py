"""The mypy ratchet (.ci/mypy_ratchet.py, `make lint`): fails on a new error anywhere, passes on fewer."""

from __future__ import annotations

import importlib.util
from collections import Counter

from helpers import ROOT

_spec = importlib.util.spec_from_file_location("mypy_ratchet", ROOT / ".ci" / "mypy_ratchet.py")
assert _spec is not None and _spec.loader is not None
ratchet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ratchet)

LINES = ["src/a.py:3: error: Function is missing a type annotation  [no-untyped-def]",
         "src/a.py:9: error: Function is missing a return type annotation  [no-untyped-def]",
         "src/b.py:1: error: Incompatible types in assignment  [assignment]"]
COUNTS = Counter({"src/a.py": 2, "src/b.py": 1})


def test_a_module_not_listed_must_be_clean() -> None:
    code, out = ratchet.verdict(COUNTS, LINES, {"src/a.py": 2})
    assert code == 1 and LINES[2] in out and "src/b.py must be typed" in out[-1]


def test_a_listed_module_with_a_new_error_fails() -> None:
    code, out = ratchet.verdict(COUNTS, LINES, {"src/a.py": 1, "src/b.py": 1})
    assert code == 1 and LINES[0] in out and LINES[2] not in out and "src/a.py (2 > 1)" in out[-1]


def test_fewer_errors_pass_and_update_only_shrinks() -> None:
    code, out = ratchet.verdict(COUNTS, LINES, {"src/a.py": 3, "src/b.py": 1, "src/c.py": 4})
    assert code == 0 and "src/a.py, src/c.py" in out[0]
    assert ratchet.shrunk(COUNTS, {"src/a.py": 1, "src/c.py": 4}) == {"src/a.py": 1}  # never up, never a new module
    assert ratchet.shrunk(COUNTS, None) == dict(COUNTS)  # the first write records everything
