"""Key docs for `launch.py --help`: every dotted key with its type, default and the comment that documents it
in spec/schema.py (the comment on the field's line, or the comment lines right above it)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from enum import Enum
from typing import Iterator

from . import schema
from .schema import RunSpec

FIELD = re.compile(r"^    (\w+): ([^=]+?)(?: = (.*?))?(?:\s+# (.*))?$")
COMMENT = re.compile(r"^\s+# ?(.*)$")
CLASS = re.compile(r"^class (\w+)")


def field_comments() -> dict[str, dict[str, str]]:
    """{class name: {field: doc}} read from schema.py's source."""
    docs: dict[str, dict[str, str]] = {}
    cls, pending = None, []
    for line in inspect.getsource(schema).splitlines():
        if m := CLASS.match(line):
            cls, pending = m.group(1), []
            docs[cls] = {}
        elif cls and (m := COMMENT.match(line)):
            pending.append(m.group(1))
        elif cls and (m := FIELD.match(line)):
            docs[cls][m.group(1)] = " ".join([*pending, m.group(4) or ""]).strip()
            pending = []
        else:
            pending = []
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
        return value.value if isinstance(value, Enum) else repr(value)
    return "[]" if f.default_factory is list else ""


def key_docs(cls: type = RunSpec, prefix: str = "", docs: dict | None = None) -> Iterator[tuple[str, str, str]]:
    """(dotted key, 'type = default', doc) for every leaf key of the schema."""
    docs = field_comments() if docs is None else docs
    for f in dataclasses.fields(cls):
        sub = f.default_factory if isinstance(f.default_factory, type) else None
        if sub is not None and dataclasses.is_dataclass(sub):
            yield from key_docs(sub, f"{prefix}{f.name}.", docs)
            continue
        kind = str(f.type)
        enum = getattr(schema, kind, None)
        if isinstance(enum, type) and issubclass(enum, Enum):
            kind = "|".join(e.value for e in enum)
        yield f"{prefix}{f.name}", f"{kind} = {_default(f)}", docs.get(cls.__name__, {}).get(f.name, "")


def render_key_docs(width: int = 44) -> str:
    lines = []
    for key, typed, doc in key_docs():
        head = f"  {key}: {typed}"
        lines.append(head if not doc else f"{head:{width}s} {doc}" if len(head) < width else f"{head}\n{'':{width}s} {doc}")
    return "\n".join(lines)
