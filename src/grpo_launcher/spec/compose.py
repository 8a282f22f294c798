"""Compose `conf/` with Hydra into a frozen RunSpec; turn every composition failure into a Violation."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict

from .errors import ConfigError, Violation
from .schema import GROUPS, RunSpec, TrainBackend

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
SCHEMA_NAME = "run_schema"
SELECTORS = (*GROUPS, "recipe")  # override keys that pick a config group option
OPTION_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# Keys that existed and were removed because nothing read them: the fix says what to do instead.
REMOVED_KEYS = {
    "train.min_lr": "removed: the schedule is linear warm-up (train.warmup_steps) then constant train.lr",
    "rollout.top_p": "removed: engines sample the full distribution (top_p=1) so the importance ratios hold",
    "rollout.top_k": "removed: engines sample the full distribution (no top-k) so the importance ratios hold",
    "rollout.colocated": "removed: rollout and training always share the devices (colocated) in this build",
    "rollout.expert_parallel_size": "removed: vLLM derives expert parallelism from the engine's TP; set "
                                    "rollout.tensor_parallel_size",
    "rollout.seq_logprob_error_threshold": "removed: nothing checked it; the driver logs "
                                           "train/gen_vs_policy_logprob_absdiff every step",
}
# hydra.* keys a single run does not use: its run dir is output_root/name (Hydra's run dir, chdir and log files
# are not used); sweeps honour hydra.sweep.* (multirun.yaml and the sweep's MLflow parent).
HYDRA_REFUSED = {
    "hydra.run.dir": "the run directory is output_root/name: set output_root=DIR and name=NAME instead",
    "hydra.job.chdir": "runs never change directory: paths stay relative to where launch.py starts",
    "hydra.output_subdir": "the resolved spec is written to output_root/name/spec.yaml, not a .hydra dir",
}


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
    ConfigStore.instance().store(name=SCHEMA_NAME, node=_unfreeze(OmegaConf.structured(RunSpec)))
    OmegaConf.register_new_resolver(PER_BACKEND, per_backend, replace=True)


PER_BACKEND = "per_backend"


def per_backend(values: Any, *, _root_: DictConfig) -> Any:
    """`key: "${per_backend:{megatron: 2, torch: 1}}"`: a recipe value that depends on train.backend (Megatron's
    TP/PP/CP/EP layout means nothing to the data-parallel torch backend). spec.yaml keeps the resolved value."""
    backend = _root_.train.backend
    name = backend.value if isinstance(backend, TrainBackend) else str(backend)
    if not isinstance(values, dict) or name not in values:
        raise ValueError(f"${{{PER_BACKEND}:...}} has no value for train.backend={name}: give one per backend, "
                         f"e.g. {{megatron: 2, torch: 1}}")
    return values[name]


def check_override_keys(overrides: list[str], multirun: bool = False) -> list[Violation]:
    """Unparsable overrides and unknown keys, each named, with the nearest valid key suggested."""
    parser, known, out = OverridesParser.create(), set(dotted_keys()), []
    for text in overrides:
        try:
            ov = parser.parse_override(text)
        except HydraException as exc:
            key = text.split("=", 1)[0].lstrip("+~")
            msg = str(exc).splitlines()[0]
            out.append(Violation("override_syntax", (key,), f"cannot parse {text!r}: {msg}",
                                 f"quote the value: {key}='...' (and quote the whole override for your shell)"))
            continue
        out.extend(_override_problems(ov, text, known, multirun))
    return out


def _override_problems(ov: Any, text: str, known: set[str], multirun: bool) -> Iterator[Violation]:
    key = ov.key_or_group
    if ov.is_sweep_override() and not multirun:
        yield Violation("override_syntax", (key,), f"{text!r} is a sweep (several values) in a single run",
                        f"add -m to sweep over {key}, or give one value")
    elif ov.is_delete() and key in known and key not in SELECTORS:  # its readers would meet no key at all
        yield Violation("override_syntax", (key,), f"'{text}' removes a key of the run spec",
                        f"set it instead: {key}=VALUE ({key}=null where its type allows)")
    elif key in SELECTORS and not ov.is_delete() and not ov.is_sweep_override():
        value = ov.value()
        if not isinstance(value, str) or not OPTION_NAME.fullmatch(value):
            yield Violation("config_group", (key,), f"{key}={ov.get_value_element_as_str()} is not one option of "
                            f"the {key} group", f"choose one: {key}=NAME (a file {key}/NAME.yaml)")
    elif key == "hydra/launcher" and str(ov.value()).startswith("submitit") and not multirun:
        yield Violation("hydra_launcher", (key,), f"{text} without -m: a Hydra launcher runs the points of a sweep",
                        f"python launch.py -m {text} KEY=a,b ... (each point a submitit job, waited for), or "
                        "python launch.py cluster=slurm [-m KEY=a,b] ... (each run its own sbatch job; the command "
                        "returns at once: launch.py status)")
    elif key.startswith("hydra.") or key.startswith("hydra/"):
        refused = next((why for k, why in HYDRA_REFUSED.items() if key == k or key.startswith(k + ".")), None)
        if refused and not (multirun and key.startswith("hydra.sweep")):
            yield Violation("hydra_key", (key,), f"{key} is not used by grpo-launcher", refused)
    elif key in REMOVED_KEYS:
        yield Violation("unknown_key", (key,), f"'{key}' is not a config key", REMOVED_KEYS[key])
    elif key not in SELECTORS and key != "hydra" and key not in known:
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean '{near[0]}'?" if near else "no similar key: see conf/ and spec/schema.py"
        yield Violation("unknown_key", (key,), f"'{key}' is not a config key", hint)


# `+key=v` on a key the config has, `~key` on a schema key or a missing one: Hydra's message names the key
EDIT_KEY = re.compile(r"An item is already at '([^']+)'|Could not delete from config\. (?:The value of )?'([^']+)'"
                      r"|force-add of config groups is not supported: '\+\+([^=']+)"
                      r"|Could not delete '([^'/]+)[^']*'\. No match|Multiple values for ([\w.]+)\."
                      r"|^([\w.]+) appears more than once in the final defaults list", re.M)
EDIT_FIXES = {
    "Could not override '": "the defaults list chooses no {key} option, so '{key}=' has none to override: add "
                            "one with {plus}",
    "Multiple values for": "{key} has an option already: choose another with {key}=NAME (no '+')",
    "appears more than once in the final defaults list": "{key} is chosen twice: give {key}=NAME once (no '+')",
    "No match in the defaults list": "no {key} option is chosen here, so there is none to remove: drop '~{key}'",
    "An item is already at": "{key} is in the config already: set it with {key}=VALUE ('+' adds a new key; "
                             "'++' sets a key whether or not it exists)",
    "does not support deletion": "a key of the run spec cannot be removed: set it ({key}=VALUE, or {key}=null "
                                 "where its type allows)",
    "force-add of config groups": "choose a {key} option with {key}=NAME ('++' adds or sets keys, not groups)",
    "Could not delete from config": "'~' removes a key the config has, with its value if given: drop '~{key}' "
                                    "or set it with {key}=VALUE",
}


def _group_options(group: str, source: Optional[ConfigSource]) -> list[str]:
    """The options of a config group: GROUP/NAME.yaml in the primary config's dir and the user's dirs."""
    source = source or ConfigSource()
    dirs = [source.conf_dir, *(Path(p.removeprefix("file://")) for p in source.search_path if "://" not in p
                               or p.startswith("file://")), CONF_DIR]
    return sorted({f.stem for d in dirs for f in (d / group).glob("*.yaml")})


def _add_group(key: str, overrides: Iterable[str], source: Optional[ConfigSource]) -> str:
    """`+KEY=VALUE` for `KEY=VALUE` on a group the defaults list does not choose (recipe=nanov3): '+' adds it."""
    value = next((o.split("=", 1)[1] for o in overrides if "=" in o and o.split("=", 1)[0] == key), None)
    options = _group_options(key, source)
    if value is not None and (value in options or not options):
        return f"+{key}={value}"
    return f"+{key}=NAME" + (f" (one of: {', '.join(options)})" if options else "")


def _composition_violation(exc: BaseException, overrides: Iterable[str] = (),
                           source: Optional[ConfigSource] = None) -> Violation:
    """Hydra/OmegaConf errors carry the key in `full_key` or in their message: surface it. `overrides` (the
    command line's) and `source` let a fix quote the override to give instead."""
    cause = exc
    while cause.__cause__ is not None and not hasattr(cause, "full_key"):
        cause = cause.__cause__
    lines = str(cause).split("\n")
    text, key = lines[0], getattr(cause, "full_key", None)
    nested = re.search(r"^\s*full_key: (\S+)$", str(cause), re.M)  # a YAML's own error, wrapped by Hydra
    if not key and nested:
        key = nested.group(1)
        text = f"{text.split(':')[0]}: {lines[1].strip()}" if len(lines) > 1 else text
    if not key:
        m = re.search(r"Could not (?:find|load|override) '([^']+)'", str(exc)) or EDIT_KEY.search(str(exc))
        key = (m.group(1).split("/")[0] if m.re is not EDIT_KEY else m.group(m.lastindex or 1)) if m else "<config>"
    options = re.search(r"Available options in '[^']+':\n((?:\t\S+\n)+)", str(exc))
    fix = "fix the value or the key named here"
    edit = next((why for pattern, why in EDIT_FIXES.items() if pattern in f"{exc}\n{cause}"), None)
    if edit:
        fix = edit.format(key=key, plus=_add_group(key, overrides, source) if "{plus}" in edit else "")
    elif options:
        fix = "choose one of: " + ", ".join(options.group(1).split())
    elif key and "not in" in text:
        near = difflib.get_close_matches(key, list(dotted_keys()), n=1, cutoff=0.6)
        fix = f"did you mean '{near[0]}'?" if near else fix
    return Violation("composition", (key,), text, fix)


@dataclasses.dataclass(frozen=True)
class ConfigSource:
    """Where configs come from: the primary config (-cn) in conf_dir, plus the user's dirs (--config-dir,
    hydra.searchpath) searched for group options (recipe/, model/, env/, ...) before conf/."""

    conf_dir: Path = CONF_DIR
    config_name: str = "config"
    search_path: tuple[str, ...] = ()

    def overrides(self) -> list[str]:
        if not self.search_path:
            return []
        paths = [p if "://" in p else f"file://{Path(p).resolve()}" for p in self.search_path]
        return ["hydra.searchpath=[" + ",".join(f"'{p}'" for p in paths) + "]"]


def compose(overrides: list[str], conf_dir: Path = CONF_DIR, source: Optional[ConfigSource] = None) -> DictConfig:
    """Compose the primary config with the overrides; raise ConfigError naming the key on failure."""
    source = source or ConfigSource(conf_dir=conf_dir)
    unknown = check_override_keys(overrides)
    parsable = [o for o in overrides if _override_key(o) not in {v.keys[0] for v in unknown}]
    unknown += value_type_problems(parsable)
    usable = [o for o in parsable if _override_key(o) not in {v.keys[0] for v in unknown}]
    register_schema()
    while True:  # an override Hydra refuses is named and left out, and the rest composed: every problem at once
        try:
            with initialize_config_dir(config_dir=str(source.conf_dir), version_base="1.3"):
                cfg = hydra_compose(config_name=source.config_name, overrides=[*source.overrides(), *usable],
                                    return_hydra_config=False)
        except Exception as exc:  # Hydra, OmegaConf, ValueError, or a file it cannot read: named, never a traceback
            unknown.append(_composition_violation(exc, usable, source))
            culprit = [o for o in usable if _override_key(o) == unknown[-1].keys[0]]
            if not culprit:
                raise ConfigError(unknown) from exc
            usable = [o for o in usable if o not in culprit]
            continue
        unresolved = unresolvable(cfg, usable)  # `KEY=${nope}`: named here, not when a reader first touches KEY
        if not unresolved:
            break
        unknown.extend(unresolved)
        usable = [o for o in usable if _override_key(o) not in {v.keys[0] for v in unresolved}]
    if unknown:
        raise ConfigError(unknown, partial=cfg)
    return cfg


def unresolvable(cfg: DictConfig, overrides: list[str]) -> list[Violation]:
    """Overrides whose interpolation does not resolve (`${nope}`, `${oc.env:UNSET}`, `${${x}}`), each named."""
    out = []
    for key in dict.fromkeys(_override_key(o) for o in overrides if "${" in o and not o.startswith("~")):
        try:
            node = OmegaConf.select(cfg, key, throw_on_missing=False)
            if OmegaConf.is_config(node):
                OmegaConf.to_container(node, resolve=True)
        except Exception as exc:  # OmegaConf's interpolation errors (a missing key, resolver or env variable)
            why = str(exc).split("\n")[0]
            out.append(Violation("composition", (key,), f"{key}: {why}",
                                 "give a value, or an interpolation that resolves (e.g. ${train.lr}; quote a "
                                 "literal '$': \\${...})"))
    return out


def value_type_problems(overrides: list[str]) -> list[Violation]:
    """Overrides of schema keys whose value the key's type refuses (grpo.max_steps=abc), each named."""
    schema, parser, known, out = _unfreeze(OmegaConf.structured(RunSpec)), OverridesParser.create(), set(dotted_keys()), []
    for text in overrides:
        ov = parser.parse_override(text)
        key, value = ov.key_or_group, None if ov.is_delete() or ov.is_sweep_override() else ov.value()
        leaf = key in known and not OmegaConf.is_dict(OmegaConf.select(schema, key, throw_on_missing=False))
        if value is None or not leaf or (isinstance(value, str) and "${" in value):
            continue  # sweeps are checked per point; null, sections and interpolations when composed
        try:
            OmegaConf.update(schema, key, value, merge=True)
        except Exception as exc:  # OmegaConf's ValidationError: the value cannot be this key's type
            why = str(exc).split("\n")[0]
            out.append(Violation("composition", (key,), f"{key}={ov.get_value_element_as_str()}: {why}",
                                 "give a value of the key's type (python launch.py --help lists each key's type)"))
            continue
        if type(value) is int and value not in (0, 1) and isinstance(OmegaConf.select(schema, key), bool):
            out.append(Violation("composition", (key,), f"{key}={ov.get_value_element_as_str()}: a number for a "
                                 f"true/false key (OmegaConf reads any integer but 0 as true)",
                                 f"write {key}=true or {key}=false"))
    return out


def _override_key(text: str) -> str:
    return re.split(r"[=@]", text.lstrip("+~"), maxsplit=1)[0]


def to_spec(cfg: Any) -> RunSpec:
    """DictConfig → frozen RunSpec (the only object passed downstream)."""
    try:
        if "hydra" in cfg:  # a config composed with its hydra node (sweep points, compose)
            cfg = _without_hydra(cfg)
        if OmegaConf.get_type(cfg) is not RunSpec:  # e.g. a spec read back from YAML
            cfg = OmegaConf.merge(_unfreeze(OmegaConf.structured(RunSpec)), cfg)
        spec = OmegaConf.to_object(cfg)
    except Exception as exc:  # OmegaConf (type, interpolation), or a value its converters choke on
        raise ConfigError([_composition_violation(exc)]) from exc
    wrong = list(_misplaced_sections(spec))
    if wrong:
        raise ConfigError(wrong)
    return spec


def _without_hydra(cfg: DictConfig) -> DictConfig:
    """A copy of `cfg` without its hydra node, which is not copied (a sweep point's hydra node is about half its
    nodes, and to_spec copied it once per point only to drop it): deepcopy takes the memo's stand-in for it."""
    stand_in = DictConfig({})
    cfg = copy.deepcopy(cfg, memo={id(cfg._get_node("hydra")): stand_in})
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _misplaced_sections(obj: Any, prefix: str = "") -> Iterator[Violation]:
    """A section replaced by another section (an interpolation such as train=${model}) or by a scalar."""
    if not isinstance(obj, RunSpec) and not prefix:
        yield Violation("composition", ("<config>",), f"the config is a {type(obj).__name__}, not a run spec",
                        "compose from conf/config.yaml (or a primary config whose defaults start with run_schema)")
        return
    for f in dataclasses.fields(obj):
        kind = f.default_factory if isinstance(f.default_factory, type) else None
        if kind is None or not dataclasses.is_dataclass(kind):
            continue
        value = getattr(obj, f.name)
        if type(value) is not kind:
            yield Violation("composition", (f"{prefix}{f.name}",), f"section {prefix}{f.name} holds a "
                            f"{type(value).__name__}, not its own keys", f"set keys inside it: {prefix}{f.name}.KEY=...")
        else:
            yield from _misplaced_sections(value, f"{prefix}{f.name}.")


def compose_all(overrides: list[str], conf_dir: Path = CONF_DIR,
                source: Optional[ConfigSource] = None) -> tuple[DictConfig, list[Violation]]:
    """compose, going on past the overrides it refuses: (the config of the rest, the problems found so far)."""
    try:
        return compose(overrides, conf_dir, source), []
    except ConfigError as err:
        if err.partial is None:
            raise
        return err.partial, list(err.violations)  # keep going: report the rules too


def load_spec(overrides: list[str], conf_dir: Path = CONF_DIR, source: Optional[ConfigSource] = None) -> RunSpec:
    """Compose, convert, read the model's checkpoint config and validate: ONE ConfigError holding every problem."""
    cfg, unknown = compose_all(overrides, conf_dir, source)
    return checked_spec(cfg, [_override_key(o) for o in overrides], unknown)


def checked_spec(cfg: Any, cli_keys: list[str], known_problems: Iterable[Violation] = (),
                 launch: bool = False) -> RunSpec:
    """A composed config → the resolved (spec/resolve.py, every fill-in once) and validated RunSpec, or ONE
    ConfigError. `launch`: a launch's pre-flight, which also draws the run's own values (resolve's HTTP key)."""
    # here: validate's rules import compose (preflight/values.py), and the job's spec.yaml reader stays light
    from .resolve import resolve
    from ..preflight.validate import validate

    cfg, problems = fill_missing(cfg, [*known_problems, *label_overrides(cli_keys)])
    try:
        spec = to_spec(cfg)
    except ConfigError as err:  # the typed spec could not be made: said with the overrides composition refused
        raise ConfigError([*problems, *err.violations]) from err
    spec, model_problems = resolve(spec, cli_keys, launch=launch)
    refused = {k for v in problems for k in v.keys}  # their values were left out: rules on them would judge defaults
    rules = [v for v in validate(spec) if not any(k == r or k.startswith(r + ".") for k in v.keys for r in refused)]
    violations = [*problems, *model_problems, *rules]
    if violations:
        raise ConfigError(violations)
    return spec


LABELS = {"loss.name": "loss"}  # keys that only record a group's choice: no code reads them


def label_overrides(cli_keys: Iterable[str]) -> list[Violation]:
    """`loss.name=dapo` set on its own changes no setting (a GRPO run labelled dapo): the group chooses them."""
    out = []
    for key in (k for k in cli_keys if k in LABELS):
        group = LABELS[key]
        options = ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))
        out.append(Violation("group_label", (key, group), f"{key} only records the {group} group's choice: set "
                             f"on its own it changes none of the {group} settings", f"choose the group instead: "
                             f"{group}=NAME ({options}); then override its keys ({group}.clip_high=...)"))
    return out


def fill_missing(cfg: Any, problems: list[Violation]) -> tuple[Any, list[Violation]]:
    """Keys left '???' (a recipe's placeholder, or `KEY=???`) are each named, and a copy of the config takes the
    schema's defaults in their place. The typed spec can then be made and every other rule still runs: all problems
    at once. A key without a default to stand in, or a config OmegaConf cannot walk, is left to to_spec."""
    try:
        keys = sorted(k for k in OmegaConf.missing_keys(cfg) if k.split(".")[0] in RunSpec.__dataclass_fields__)
        if not keys:
            return cfg, problems
        defaults = OmegaConf.structured(RunSpec)
        if any(OmegaConf.is_missing(defaults, k) for k in keys):
            return cfg, problems
        filled = copy.deepcopy(cfg)
        for k in keys:
            OmegaConf.update(filled, k, OmegaConf.select(defaults, k), merge=False)
    except Exception:  # a config to_spec itself refuses, with its own message
        return cfg, problems
    return filled, [*problems, *(Violation("composition", (k,), "no value given ('???')",
                                           f"give it one: {k}=VALUE") for k in keys)]


def leaf_values(obj: Any, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) of every leaf field of a spec section."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from leaf_values(value, f"{key}.")
        else:
            yield key, value


def roundtrip_problems(spec: RunSpec, read_back: Optional[Any] = None) -> list[Violation]:
    """The spec the job reads back must be this spec: reload it (read_back(spec), default: its YAML text, in memory)
    and compare, key by key."""
    try:
        back = read_back(spec) if read_back else to_spec(OmegaConf.create(spec_to_yaml(spec)))
    except ConfigError as err:
        return [Violation("spec_roundtrip", v.keys, f"the job could not read spec.yaml back: {v.message}", v.fix)
                for v in err.violations]
    except Exception as exc:
        return [Violation("spec_roundtrip", ("<spec>",), f"the job could not read spec.yaml back: {exc}",
                          "use plain values")]
    theirs = dict(leaf_values(back))
    return [Violation("spec_roundtrip", (key,), f"{value!r} reads back from spec.yaml as {theirs.get(key)!r}",
                      f"set {key} to a plain value")
            for key, value in leaf_values(spec) if theirs.get(key) != value]


def spec_to_yaml(spec: RunSpec) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(spec))
