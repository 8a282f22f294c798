"""Registries map short names (what configs say) to "module:Class" paths, imported only when used."""

from __future__ import annotations

import importlib


def load(registry: dict[str, str], name: str) -> type:
    module, _, cls = registry[name].partition(":")
    return getattr(importlib.import_module(module), cls)
