"""Environments: where prompts come from and how completions are scored. Registry keyed by env.name."""

from __future__ import annotations

from .base import Env, Prompt
from .math import MathEnv
from .toy import ReverseDigitsEnv

ENVS: dict[str, type] = {"toy": ReverseDigitsEnv, "math": MathEnv}


class EnvNotAvailable(RuntimeError):
    pass


def make_env(spec) -> Env:
    name = spec.env.name.value
    if name not in ENVS:
        raise EnvNotAvailable(
            f"env={name} is validated and planned, but running it needs its external servers "
            f"(NeMo Gym resource servers are not part of this build); runnable envs: {', '.join(ENVS)}")
    return ENVS[name](spec.env, seed=spec.grpo.seed)


__all__ = ["ENVS", "Env", "EnvNotAvailable", "Prompt", "make_env"]
