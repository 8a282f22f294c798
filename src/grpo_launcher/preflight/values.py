"""Every leaf value can travel to the job and back; and what this build runs (backends, versions, trackers)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from enum import Enum
from typing import Any, Iterator

from ..spec.compose import leaf_values
from ..spec.errors import Violation
from ..spec.schema import RunSpec
from ..spec.versions import untested
from .registry import V, build_gap, rule

INT_LIMIT = 2**31 - 1  # every count, size, port and seed of the schema fits (torch, Ray and Slurm take int32)
MAX_TEXT = 4096
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def value_problem(value: object) -> str | None:
    """Why a single value cannot travel to the job and back (spec.yaml, sbatch, Ray), or None."""
    if value is None or isinstance(value, (bool, Enum)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"must be a finite number, got {value}"
    if isinstance(value, int):
        return None if abs(value) <= INT_LIMIT else f"{str(value)[:12]}... ({len(str(value))} digits) is out of range"
    if isinstance(value, str):
        if CONTROL_CHARS.search(value):
            return f"{value[:40]!r} holds a line break or control character"
        if "${" in value:
            return f"{value[:40]!r} holds '${{': the job would resolve it as an interpolation when it reads spec.yaml"
        return None if len(value) <= MAX_TEXT else f"is {len(value)} characters long (at most {MAX_TEXT})"
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, (list, tuple, dict)):
                return f"items must be plain values, got a nested {type(item).__name__}"
            why = value_problem(item)
            if why:
                return f"item {why}"
        return None
    return f"unexpected value of type {type(value).__name__}"


@rule("pure")
def field_values(s: RunSpec) -> Iterator[Violation]:
    """Every leaf value: finite floats, int32-sized integers, one-line text without `${`, flat lists."""
    for key, value in leaf_values(s):
        why = value_problem(value)
        if why:
            yield V("field_values", key, why, f"set {key} to a plain, finite, one-line value")
    warn_of_inert_keys(s)  # (a warning: keys set that nothing reads here)


PATH_KEYS = ("path", "paths", "root", "_dir", "python", "mounts")  # key suffixes of the values used as paths
NAME_MAX, PATH_MAX = 255, 4096  # Linux's limits, in bytes: os.stat past them raises OSError (ENAMETOOLONG)


def path_problem(value: str) -> str | None:
    """Why a path cannot be stat'ed on Linux (a component or the whole too long), or None."""
    size = len(os.fsencode(value))
    longest = max((len(os.fsencode(part)) for part in re.split(r"[/:]", value)), default=0)
    if longest > NAME_MAX:
        return f"has a path component of {longest} bytes (at most {NAME_MAX}): no file can have that name"
    return None if size <= PATH_MAX else f"is a path of {size} bytes (at most {PATH_MAX})"


@rule("pure", name="field_values")
def path_lengths(s: RunSpec) -> Iterator[Violation]:
    """Paths (and the run name, a directory) within Linux's name and path lengths: beyond them every stat of the
    run dir, the data or the model fails with ENAMETOOLONG instead of a config error."""
    for key, value in leaf_values(s):
        items = value if isinstance(value, (list, tuple)) else [value]
        if key == "name" or key.endswith(PATH_KEYS):
            why = next((w for w in (path_problem(v) for v in items if isinstance(v, str)) if w), None)
            if why:
                yield V("field_values", key, why, f"shorten {key}")


@rule("pure", name="field_values")
def list_keys_hold_lists(s: RunSpec) -> Iterator[Violation]:
    """A list key holds a list: an interpolation of a scalar into one (cluster.container_mounts=${train.lr}) passes
    OmegaConf's merge unchecked, and the job's reload of spec.yaml would refuse it on the node."""
    for key, value in non_lists(s):
        yield V("field_values", key, f"is a list key but holds the {type(value).__name__} {str(value)[:40]!r} "
                "(an interpolation of a single value?)", f"set {key} to a list: {key}=[a,b] (or [${{...}}])")


def non_lists(obj: Any, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) of every list-typed field whose value is not a list."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from non_lists(value, f"{key}.")
        elif str(f.type).startswith(("list[", "tuple[")) and not isinstance(value, (list, tuple)):
            yield key, value


@rule("probe")
def build_implements_run(s: RunSpec) -> Iterator[Violation]:
    """Backend × family × layout × env this build cannot run: refused before anything is started or submitted
    (a dry run still plans and renders, so recipes for other builds stay inspectable). The rooms check their own
    parts under this name (policy/rules.py, gym/rules.py)."""
    m = s.model
    for package, why in untested(s):
        yield build_gap(("cluster.untested_versions",), f"{why} (this interpreter's, which the run uses)",
                        f"install a tested {package} (src/grpo_launcher/spec/versions.py), or set "
                        "cluster.untested_versions=true")
    builds = (m.family == "qwen2" and not m.num_experts) or (m.family == "nemotron_h" and m.num_experts > 0)
    if m.path is None and (not builds or m.tie_word_embeddings):
        yield build_gap(("model.path", "model.family", "model.num_experts", "model.tie_word_embeddings"),
                        f"model.path=null builds an untied dense Qwen2 or MoE nemotron_h model here (models/), not "
                        f"family={m.family}, num_experts={m.num_experts}, tie_word_embeddings={m.tie_word_embeddings}",
                        "set model.path to an HF checkpoint directory of that architecture")


@rule("pure")
def trackers_installed(s: RunSpec) -> Iterator[Violation]:
    """logging.wandb and logging.tensorboard need their packages (dependencies of this package); the W&B project
    (WANDB_PROJECT, else logging.experiment) must be a name wandb's own settings accept."""
    if s.logging.wandb and importlib.util.find_spec("wandb") is None:
        yield V("trackers_installed", "logging.wandb", "the `wandb` package is not installed",
                "pip install wandb (a dependency of this package: reinstall it), or logging.wandb=false")
    elif s.logging.wandb:
        import wandb  # here: heavy, and maybe not installed (the branch above)
        from wandb.errors import UsageError

        project = os.environ.get("WANDB_PROJECT") or s.logging.experiment
        try:
            wandb.Settings(project=project)
        except UsageError as exc:
            key = "WANDB_PROJECT" if os.environ.get("WANDB_PROJECT") else "logging.experiment"
            yield V("trackers_installed", ("logging.wandb", key), f"W&B refuses the project from {key}: {exc}",
                    f"set {key} to a W&B project name (no / \\ # ? % :, at most 128 characters)")
    if s.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        yield V("trackers_installed", "logging.tensorboard", "the `tensorboard` package is not installed",
                "pip install tensorboard (a dependency of this package: reinstall it), or logging.tensorboard=false")


# Keys that nothing reads in some configurations: (keys, when they are inert, why). A key set away from its schema
# default while it is inert is a warning naming it and the key that switches it off (the run goes on: the user
# may have meant the other key).
INERT: tuple[tuple[tuple[str, ...], Any, str], ...] = (
    (("loss.kl_estimator", "loss.kl_clamp"), lambda s: s.loss.kl_coef == 0, "loss.kl_coef=0: no KL term"),
    (("loss.dynamic_sampling_max_rounds",), lambda s: not s.loss.dynamic_sampling, "loss.dynamic_sampling=false"),
    (("rollout.http_host", "rollout.http_api_key"), lambda s: not s.rollout.expose_http_server,
     "rollout.expose_http_server=false: no HTTP server"),
    (("rollout.gpu_memory_utilization", "rollout.kv_cache_memory_mb", "rollout.enforce_eager"),
     lambda s: s.rollout.backend.value != "vllm", "rollout=hf: vLLM's settings"),
    (("grpo.async_grpo.max_trajectory_age_steps",), lambda s: not s.grpo.async_grpo.enabled,
     "grpo.async_grpo.enabled=false"),
    (("cluster.partition", "cluster.account", "cluster.qos", "cluster.time", "cluster.job_name", "cluster.exclusive",
      "cluster.container_image", "cluster.container_mounts", "cluster.python", "cluster.signal_before_s",
      "cluster.requeue"), lambda s: s.cluster.kind.value == "local", "cluster=local: Slurm's settings"),
    (("rollout.hf_compile",), lambda s: s.cluster.gpus_per_node == 0 and s.rollout.backend.value == "hf",
     "a CPU run: the hf engine compiles on CUDA only"),
    (("train.core_attention",), lambda s: s.train.backend.value != "megatron", "train.backend=torch: megatron's"),
    (("env.num_val_prompts",), lambda s: s.env.name in ("math", "dataset", "nemo_gym"),
     "env=math/dataset/nemo_gym read their held-out set from a file"),
    (("checkpoint.save_period", "checkpoint.keep_top_k", "checkpoint.metric", "checkpoint.higher_is_better"),
     lambda s: not s.checkpoint.enabled, "checkpoint.enabled=false: no checkpoint is written"),
    (("deadlines.factor", "deadlines.floor_s", "deadlines.first_s", "deadlines.window"), lambda s: not s.deadlines.enabled,
     "deadlines.enabled=false"),
    (("logging.train_data_log_every",), lambda s: not s.logging.train_data_log, "logging.train_data_log=false"),
    (("env.gym_config_paths", "env.gym_overrides", "env.gym_tool_call_parser", "env.gym_start_timeout_s"),
     lambda s: s.env.name in ("toy", "math", "dataset"), "env is not nemo_gym"),
)


def inert_keys(s: RunSpec) -> list[str]:
    """'key=value (why)' for each key of INERT set away from its default where nothing reads it."""
    default, out = RunSpec(), []
    for keys, inert, why in INERT:
        if not inert(s):
            continue
        for key in keys:
            value, base = _at(s, key), _at(default, key)
            if value != base:
                out.append(f"{key}={value.value if isinstance(value, Enum) else value} ({why})")
    return out


def _at(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def warn_of_inert_keys(s: RunSpec) -> None:
    """A warning, never a refusal (field_values calls it): keys set that this configuration never reads."""
    inert = inert_keys(s)
    if inert:
        from ..envs.preflight import warn  # the pre-flight warnings' one voice (stderr, once per process)

        warn("keys set (on the command line or by a config group) that nothing reads in this configuration: "
             + "; ".join(inert))
