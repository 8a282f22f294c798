"""The Gym room's pre-flight rules (preflight/validate.py lists this module in RULE_MODULES)."""

from __future__ import annotations

from typing import Iterator

from ..spec.errors import Violation
from ..preflight.registry import V, build_gap, rule
from ..spec.schema import EnvName, RolloutBackend, RunSpec


@rule("pure")
def gym_needs_async_http_vllm(s: RunSpec) -> Iterator[Violation]:
    """The seed recipe's first review bug: NeMo Gym talks to the engine over HTTP, async."""
    if s.env.name != EnvName.nemo_gym:
        return
    r = s.rollout
    if r.backend != RolloutBackend.vllm:
        yield V("gym_needs_async_http_vllm", ("rollout.backend", "env.name"),
                "env=nemo_gym drives generation through vLLM's HTTP server", "set rollout=vllm")
    if not r.async_engine:
        yield V("gym_needs_async_http_vllm", ("rollout.async_engine", "env.name"),
                "env=nemo_gym needs the async vLLM engine (NeMo-RL asserts this only after start-up; "
                "its runner silently rewrites the value)", "set rollout.async_engine=true")
    if not r.expose_http_server:
        yield V("gym_needs_async_http_vllm", ("rollout.expose_http_server", "env.name"),
                "env=nemo_gym sends its requests to the engine's OpenAI-compatible server",
                "set rollout.expose_http_server=true")
    if not s.env.gym_config_paths:
        yield V("gym_needs_async_http_vllm", ("env.gym_config_paths",),
                "no Gym resource-server configs given", "list at least the vllm_model_for_training config")


@rule("pure")
def gym_preflight(s: RunSpec) -> Iterator[Violation]:
    """env=nemo_gym: the Gym overrides and start timeout (gym/preflight.py check)."""
    if s.env.name == EnvName.nemo_gym:
        from .preflight import check  # here: it imports install.py (gym_available below says why)

        for keys, message, fix in check(s):
            yield V("gym_preflight", keys, message, fix)


@rule("probe", name="gym_preflight")
def gym_install_and_rows(s: RunSpec) -> Iterator[Violation]:
    """env=nemo_gym: Gym configs, servers installed, rows and one agent per agent_ref (gym/preflight.py probe)."""
    if s.env.name == EnvName.nemo_gym:
        from .preflight import probe  # (the same)

        for keys, message, fix in probe(s):
            yield V("gym_preflight", keys, message, fix)


def gym_available() -> bool:
    """Can this build run env=nemo_gym? NeMo Gym's own venv (`make gym`; grpo_launcher/gym/install.py) is there."""
    try:
        from .install import installed  # here: the guard below
    except Exception:  # the gym package itself is broken: the run could not start either
        return False
    return installed()


@rule("probe", name="build_implements_run")
def gym_installed(s: RunSpec) -> Iterator[Violation]:
    """env=nemo_gym needs NeMo Gym installed (preflight/values.py build_implements_run: what this build cannot run)."""
    if s.env.name == EnvName.nemo_gym and not gym_available():
        yield build_gap(("env.name",), "env=nemo_gym needs NeMo Gym and its resource servers, which this build does not "
                        "have installed", "use env=toy|math|dataset, or install NeMo Gym (scripts/gym-install.sh)")
