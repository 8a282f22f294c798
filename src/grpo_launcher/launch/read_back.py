"""spec.yaml's round trip (pre-flight's last check) for a spec like one that already passed it: leaf by leaf.

The full check (preflight.read_back_as_the_job) writes the spec as a run dir gets it and reads it as the job
does: OmegaConf's YAML dump of the structured spec, redacted line by line (secrets.redact_text), the secret
leaves in .secrets.json, then the schema merged with the file and the secrets, typed again (to_spec). Every step
treats a leaf alone: its YAML lines depend on its key path and value only, redaction goes line by line, secrets
leaf by leaf, the schema converts field by field. Only an interpolation (`${`) or OmegaConf's missing marker
(`???`) reaches beyond its leaf, and a spec holding either never takes this path.

So a spec whose leaves equal (same type, same value) those of a spec that passed the full check, except leaves
that each pass it alone, passes it too. A leaf passes alone when its value has exactly the type its field
declares (OmegaConf's conversion is then the identity), and either it is no secret, its YAML at its key path
(dumped by OmegaConf) is left as it is by the redaction, and it loads back as the same value of the same type;
or it is a secret string whose YAML and redacted YAML are one line each, the redacted line loading back as a
string (what the file holds until the job writes the secret over it) and the secret coming back from JSON as
itself. Anything else (another type, a list of sections, a secret on several lines ...) is for the full check.
A sweep's 64 points that differ in grpo.seed and name: one full check, 63 of two leaves each; with
rollout.expose_http_server each point also draws its own HTTP key (a secret leaf): 63 of three leaves.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from typing import Any, Optional

from omegaconf import OmegaConf

from ..secrets import has_secret, redact_text
from ..spec.compose import leaf_values
from ..spec.schema import RunSpec

KEEP = 4  # specs that passed the full check, kept to compare with (a sweep's shapes; newest first)
_PASSED: list[dict[str, Any]] = []


def passed(spec: RunSpec) -> None:
    """`spec` read back as itself through the full check: later specs may be compared with it."""
    _PASSED.insert(0, dict(leaf_values(spec)))
    del _PASSED[KEEP:]


def reads_back_like_one_before(spec: RunSpec) -> bool:
    """True when spec.yaml of `spec` reads back as `spec`, shown from a spec that passed the full check and the
    leaves where they differ; False when that cannot be shown (the full check decides then)."""
    leaves = dict(leaf_values(spec))
    if any(_reaches_beyond(v) for v in leaves.values()):
        return False
    for before in _PASSED:
        if before.keys() == leaves.keys():
            differ = [k for k, v in leaves.items() if not same(v, before[k])]
            if all(leaf_reads_back(k, leaves[k]) for k in differ):
                return True
    return False


def same(a: Any, b: Any) -> bool:
    """Equal and of the same type, all the way down (1 == 1.0 == True, and 0.0 == -0.0, are not the same here;
    nan is not nan, as the full check's comparison has it)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return a == b and repr(a) == repr(b)
    return bool(a == b)


def _reaches_beyond(value: Any) -> bool:
    """A value OmegaConf would not keep as it is (an interpolation, the missing marker), or a container of one."""
    if isinstance(value, str):
        return "${" in value or value == "???"
    if isinstance(value, (list, tuple)):
        return any(map(_reaches_beyond, value))
    if isinstance(value, dict):
        return any(map(_reaches_beyond, [*value, *value.values()]))
    return False


def leaf_reads_back(key: str, value: Any) -> bool:
    """The leaf alone passes the check (module docstring): declared type, no secret, untouched by redaction,
    loaded back from its YAML as the same value of the same type. Remembered per (key, repr): a value of the
    key's declared type (exact types, checked first) is the only one with its repr, and a sweep over group choices
    compares the same model, rollout ... leaves with the spec that passed, point after point."""
    hint = field_type(key)
    if hint is None or not declared(hint, value):
        return False
    seen = (key, repr(value))
    if seen not in _VERDICTS:
        if len(_VERDICTS) > 10_000:
            _VERDICTS.clear()
        _VERDICTS[seen] = reads_back_alone(key, value)
    return _VERDICTS[seen]


_VERDICTS: dict[tuple[str, str], bool] = {}


def reads_back_alone(key: str, value: Any) -> bool:
    """leaf_reads_back's check itself, for a value of the declared type."""
    plain = value.name if isinstance(value, enum.Enum) else value  # as OmegaConf dumps an enum: its name
    if isinstance(plain, list):
        plain = [v.name if isinstance(v, enum.Enum) else v for v in plain]
    doc: Any = plain
    for part in reversed(key.split(".")):
        doc = {part: doc}
    text = OmegaConf.to_yaml(OmegaConf.create(doc))
    if has_secret(key, plain):
        return secret_reads_back(key, plain, text)
    if redact_text(text) != text:
        return False
    return same(at(key, OmegaConf.to_container(OmegaConf.create(text))), plain)


def secret_reads_back(key: str, value: Any, text: str) -> bool:
    """A secret leaf (a sweep point's fresh HTTP key): spec.yaml holds its line redacted, .secrets.json the value
    (JSON), which the job writes over the redacted one. It passes alone when it is a string (so is the field: the
    redacted text merges into it), its YAML and the redacted YAML are one line each, the redacted line loads back
    as a string, and the value comes back from JSON as itself."""
    redacted, depth = redact_text(text), key.count(".") + 1
    if type(value) is not str or len(text.splitlines()) != depth or len(redacted.splitlines()) != depth:
        return False
    try:
        shown = at(key, OmegaConf.to_container(OmegaConf.create(redacted)))
    except Exception:  # noqa: BLE001  (the redacted line no longer parses: the full check says what the job sees)
        return False
    return type(shown) is str and same(json.loads(json.dumps(value)), value)


def at(key: str, tree: Any) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree


@functools.lru_cache(maxsize=None)
def field_type(key: str) -> Optional[Any]:
    """The type a RunSpec leaf's field declares ('grpo.seed' → int), None if the key names no leaf field."""
    cls: Any = RunSpec
    *sections, leaf = key.split(".")
    for part in sections:
        cls = typing.get_type_hints(cls).get(part)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return None
    return typing.get_type_hints(cls).get(leaf)


def declared(hint: Any, value: Any) -> bool:
    """`value` has exactly a type `hint` allows: str, int, float, bool, an Enum, Optional of one, a list of one."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # Optional[X] only (a union of types converts by its own rules)
        return len(args) == 2 and type(None) in args and (value is None or declared(args[args[0] is type(None)], value))
    if origin is list:
        return type(value) is list and len(args) == 1 and all(declared(args[0], v) for v in value)
    if hint in (str, int, float, bool):
        return type(value) is hint
    return isinstance(hint, type) and issubclass(hint, enum.Enum) and type(value) is hint
