"""env=nemo_gym: NeMo Gym's agents and resources servers as the environment, over our vLLM HTTP servers.

    install.py    where `make gym` put Gym's own venv (Python >= 3.13.14, nemo-gym 0.7.0); `installed()`
    servers.py    Gym's lifecycle for one run: env.yaml, `gym env start`, readiness, liveness, stop by PID
    rollouts.py   rows → agents' /run, concurrently; failures counted, dead servers fail fast
    samples.py    a /run result → a sample: the engine's token ids, logprobs, per-token loss mask, contiguity
    env.py        GymEnv: Gym JSONL rows per step; names the loop's rollout source (train/gym_loop.py GymSource)
    serving.py    what our HTTP server needs for Gym (chat template, tool-call parser, the prefix-token route:
                  turn k+1's prompt keeps the engine's own tokens of turns 1..k)
    preflight.py  checks before launch (files, install, one agent per agent_ref)
"""

from __future__ import annotations

from ..envs import env_class


def register_env() -> None:
    """env.name=nemo_gym is in the env registry already (envs.LAZY_ENVS: GymEnv, imported on first use); this
    imports it now (kept for callers from before the registry entry)."""
    env_class("nemo_gym")


def installed() -> bool:
    from .install import installed as _installed  # here: a broken gym/ must not stop pre-flight (gym/rules.py)

    return _installed()
