"""A sweep's points composed as Hydra's `load_sweep_config` composes them, what they share composed once.

Hydra composes every point from scratch: its defaults list (every config file read, parsed and merged) and
then its `key=value` overrides applied to the result. The defaults list depends only on the point's config
group choices (and hydra.* and the +/++/~ overrides), never on a plain `key=value`, which Hydra applies after
composing (ConfigLoaderImpl._load_configuration_impl). So the points of a sweep that choose the same groups
share one Hydra composition, made with their other overrides only ("the base"); each point is a copy of it
with its own `key=value` overrides applied by Hydra's own code, in their order, and the hydra node's fields
that name the overrides (hydra.overrides.task, hydra.job.override_dirname) set as Hydra sets them.

A point for which any of that does not hold or fails (an override of its own into hydra.*, one that does not
apply) is composed by Hydra's load_sweep_config itself, so its config, or its error, is Hydra's.
"""

import copy
from typing import Any, Dict, List, Sequence, Tuple

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf


class SharedCompose:
    """point overrides → the point's DictConfig, equal to `loader.load_sweep_config(master, overrides)`."""

    def __init__(self, loader: Any, master: DictConfig) -> None:
        self.loader, self.master = loader, master
        self.config_name = master.hydra.job.config_name
        self.hydra_overrides: List[str] = list(OmegaConf.to_container(master.hydra.overrides.hydra))
        self.parser = OverridesParser.create()
        _, self.repo = loader._parse_overrides_and_create_caching_repo(self.config_name, self.hydra_overrides)
        self.bases: Dict[Tuple[str, ...], DictConfig] = {}

    def __call__(self, overrides: Sequence[str]) -> DictConfig:
        parsed = self.parser.parse_overrides(list(overrides))
        if any(o.key_or_group == "hydra" or o.is_hydra_override() for o in parsed):
            return self.loader.load_sweep_config(self.master, list(overrides))
        own = self.applied_later(parsed)
        kept = tuple(o.input_line for o in parsed if all(o is not m for m in own))
        try:
            cfg = copy.deepcopy(self.base(kept))
            ConfigLoaderImpl._apply_overrides_to_config(own, cfg)
        except Exception:  # the point's error as Hydra reports it
            return self.loader.load_sweep_config(self.master, list(overrides))
        name_the_overrides(cfg, [o for o in parsed if not o.is_hydra_override()])
        OmegaConf.copy_cache(from_config=self.master, to_config=cfg)
        return cfg

    def applied_later(self, parsed: List[Override]) -> List[Override]:
        """The plain `key=value` overrides (no group, package, +/++/~, dict value), in their order, whose key
        no other value override of the point touches (so applying them after the others changes nothing)."""
        value = [o for o in parsed if isinstance(o.value(), dict) or not self.repo.group_exists(o.key_or_group)]
        plain = [o for o in value if o.type == OverrideType.CHANGE and o.package is None
                 and not isinstance(o.value(), dict)]
        others = [o.key_or_group for o in value if all(o is not p for p in plain)]
        return [o for o in plain if not any(overlap(o.key_or_group, k) for k in others)]

    def base(self, kept: Tuple[str, ...]) -> DictConfig:
        """Hydra's composition of the master's hydra overrides and `kept` (cached; never handed out)."""
        if kept not in self.bases:
            self.bases[kept] = self.loader.load_configuration(config_name=self.config_name, run_mode=RunMode.RUN,
                                                              overrides=[*self.hydra_overrides, *kept])
        return self.bases[kept]


def overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def name_the_overrides(cfg: DictConfig, app_overrides: List[Override]) -> None:
    """hydra.overrides.task and hydra.job.override_dirname as Hydra's composition of all the point's overrides
    sets them (the base's name only its own)."""
    task = cfg.hydra.overrides.task
    while len(task):
        task.pop()
    for o in app_overrides:
        task.append(o.input_line)
    dirname = cfg.hydra.job.config.override_dirname
    cfg.hydra.job.override_dirname = get_overrides_dirname(overrides=app_overrides, kv_sep=dirname.kv_sep,
                                                           item_sep=dirname.item_sep,
                                                           exclude_keys=dirname.exclude_keys)

