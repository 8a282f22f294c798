"""Registries map the schema's Enum members (what configs say) to "module:Class" paths, imported only when used.

The schema's Enums are str Enums, so a plain name ("torch") finds its member's entry too.
tests/unit/test_registries.py checks that every Enum member has an implementation and every entry a member.
"""

from __future__ import annotations

import importlib
from typing import Mapping, TypeVar

K = TypeVar("K", bound=str)


def load(registry: Mapping[K, str], name: K) -> type:
    module, _, cls = registry[name].partition(":")
    return getattr(importlib.import_module(module), cls)
