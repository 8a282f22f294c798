"""Environments: where prompts come from and how completions are scored. Registry keyed by env.name.

env.name is a built-in (toy, math, dataset; nemo_gym, imported on first use: LAZY_ENVS), a name registered in
ENVS by a program that calls launch.main, or a user class "package.module:Class" / "path/to/envs.py:Class"
implementing the Env protocol (envs/base.py), constructed as Class(env_spec, seed=grpo.seed).
"""

from __future__ import annotations

import importlib
import os
import re

from .base import Env, Prompt
from .dataset import DatasetEnv
from .math import MathEnv
from .toy import ReverseDigitsEnv
from .rewards import reward_refs
from .usercode import UserCodeError, is_ref, load_ref, loaded_snapshot, pickle_by_value_if_local, seed_loaded
from ..spec.schema import EnvName

# keyed by the built-in env.name values (schema.EnvName, a str Enum); a program calling launch.main may add its own
ENVS: dict[str, type] = {EnvName.toy: ReverseDigitsEnv, EnvName.math: MathEnv, EnvName.dataset: DatasetEnv}
PLANNED_ONLY = (EnvName.nemo_gym,)
# built-ins in an optional part of the package, imported on first use by env_class (NeMo Gym's client is not
# imported for the other envs); the class may name its loop's rollout source (rollout_source(): train/sources.py)
LAZY_ENVS: dict[str, str] = {"nemo_gym": "grpo_launcher.gym.env:GymEnv"}
ENV_METHODS = ("train_prompts", "val_prompts", "score")


class EnvNotAvailable(RuntimeError):
    pass


def env_class(name: str) -> type:
    """The class env.name names: a registered name, or a user class loaded from its module or file."""
    if name in ENVS:
        return ENVS[name]
    if name in LAZY_ENVS:
        module, _, attr = LAZY_ENVS[name].partition(":")
        return ENVS.setdefault(name, getattr(importlib.import_module(module), attr))
    if name in PLANNED_ONLY:
        raise EnvNotAvailable(
            f"env={name} is validated and planned, but running it needs its external servers "
            f"(NeMo Gym resource servers are not part of this build); runnable envs: {', '.join(ENVS)}")
    if not is_ref(name):
        raise EnvNotAvailable(f"env.name={name!r} is not an env: use one of {', '.join(ENVS)} or 'module:Class'")
    cls = load_ref(name, "env.name")
    missing = [m for m in ENV_METHODS if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise UserCodeError(f"env.name={name}: {cls!r} is not an Env class"
                            + (f" (no {', '.join(missing)} method)" if missing else ""))
    return cls


class EnvFactory:
    """What an env Ray worker needs to build the driver's env: the class object itself, pickled (by value
    for user code outside installed packages), so a class registered at run time or loaded from a file is
    the one that scores, never a fresh re-import of the package's registry."""

    def __init__(self, spec):
        self.cls, self.env_spec, self.seed = env_class(spec.env.name), spec.env, spec.grpo.seed
        refs = [ref for key, ref, _ in reward_refs(spec.env)]
        for key, ref, _ in reward_refs(spec.env):
            load_ref(ref, key)
        self.loaded = loaded_snapshot(refs)  # the reward functions as loaded here, whatever the worker's cwd
        self.pid = os.getpid()
        pickle_by_value_if_local(self.cls, *self.loaded.values())

    def __call__(self) -> Env:
        if os.getpid() != self.pid:  # in the env worker: use what the driver loaded
            seed_loaded(self.loaded)
        return self.cls(self.env_spec, seed=self.seed)


def make_env(spec) -> Env:
    return EnvFactory(spec)()


def env_label(name: str) -> str:
    """env.name as a file-name-safe label (the tiny model's cache directory)."""
    return name if name in ENVS else re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[-48:]


__all__ = ["ENVS", "Env", "EnvFactory", "EnvNotAvailable", "Prompt", "UserCodeError", "env_class", "env_label",
           "make_env"]
