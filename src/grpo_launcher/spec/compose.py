"""Compose `conf/` with Hydra into a frozen RunSpec; turn every composition failure into a Violation."""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError, Violation
from .schema import GROUPS, RunSpec

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
SCHEMA_NAME = "run_schema"
SELECTORS = (*GROUPS, "recipe")  # override keys that pick a config group option


def dotted_keys(cls: type = RunSpec, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the schema, e.g. 'grpo.num_prompts_per_step'."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        yield key
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            yield from dotted_keys(f.default_factory, f"{key}.")


def _unfreeze(node: DictConfig) -> DictConfig:
    """Frozen dataclasses become read-only nodes; composition must merge into them, so clear it."""
    node._set_flag("readonly", None)
    for key in node.keys():
        child = node._get_node(key)
        if OmegaConf.is_dict(child):
            _unfreeze(child)
        else:
            child._set_flag("readonly", None)
    return node


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=_unfreeze(OmegaConf.structured(RunSpec)))


def check_override_keys(overrides: list[str]) -> list[Violation]:
    """Unparsable overrides and unknown keys, each named, with the nearest valid key suggested."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, known, out = OverridesParser.create(), set(dotted_keys()), []
    for text in overrides:
        try:
            key = parser.parse_override(text).key_or_group
        except HydraException as exc:
            key = text.split("=", 1)[0].lstrip("+~")
            msg = str(exc).splitlines()[0]
            out.append(Violation("override_syntax", (key,), f"cannot parse {text!r}: {msg}",
                                 f"quote the value: {key}='...' (and quote the whole override for your shell)"))
            continue
        if key in SELECTORS or key.startswith("hydra") or key in known:
            continue
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean '{near[0]}'?" if near else "no similar key: see conf/ and spec/schema.py"
        out.append(Violation("unknown_key", (key,), f"'{key}' is not a config key", hint))
    return out


def _composition_violation(exc: BaseException) -> Violation:
    """Hydra/OmegaConf errors carry the key in `full_key` or in their message: surface it."""
    cause = exc
    while cause.__cause__ is not None and not hasattr(cause, "full_key"):
        cause = cause.__cause__
    text = str(cause).split("\n")[0]
    key = getattr(cause, "full_key", None)
    if not key:
        m = re.search(r"Could not (?:find|load|override) '([^']+)'", str(exc))
        key = m.group(1).split("/")[0] if m else "<config>"
    options = re.search(r"Available options in '[^']+':\n((?:\t\S+\n)+)", str(exc))
    fix = "fix the value or the key named here"
    if options:
        fix = "choose one of: " + ", ".join(options.group(1).split())
    elif key and "not in" in text:
        near = difflib.get_close_matches(key, list(dotted_keys()), n=1, cutoff=0.6)
        fix = f"did you mean '{near[0]}'?" if near else fix
    return Violation("composition", (key,), text, fix)


def compose(overrides: list[str], conf_dir: Path = CONF_DIR) -> DictConfig:
    """Compose conf/config.yaml with the overrides; raise ConfigError naming the key on failure."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    unknown = check_override_keys(overrides)
    usable = [o for o in overrides if not any(o.lstrip("+~").startswith(v.keys[0] + "=") for v in unknown)]
    register_schema()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=usable)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError([*unknown, _composition_violation(exc)]) from exc
    if unknown:
        raise ConfigError(unknown, partial=cfg)
    return cfg


def to_spec(cfg: Any) -> RunSpec:
    """DictConfig → frozen RunSpec (the only object passed downstream)."""
    try:
        if OmegaConf.get_type(cfg) is not RunSpec:  # e.g. a spec read back from YAML
            cfg = OmegaConf.merge(_unfreeze(OmegaConf.structured(RunSpec)), cfg)
        if "hydra" in cfg:  # a config composed with its hydra node (sweep points)
            cfg = cfg.copy()
            with open_dict(cfg):
                del cfg["hydra"]
        spec = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError([_composition_violation(exc)]) from exc
    assert isinstance(spec, RunSpec), type(spec)
    return spec


def load_spec(overrides: list[str], conf_dir: Path = CONF_DIR) -> RunSpec:
    """Compose, convert and validate: raise ONE ConfigError holding every problem found."""
    from .rules import validate

    try:
        spec = to_spec(compose(overrides, conf_dir))
        unknown = []
    except ConfigError as err:
        if err.partial is None:
            raise
        spec, unknown = to_spec(err.partial), err.violations  # keep going: report the rules too
    violations = [*unknown, *validate(spec)]
    if violations:
        raise ConfigError(violations)
    return spec


def spec_to_yaml(spec: RunSpec) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(spec))
