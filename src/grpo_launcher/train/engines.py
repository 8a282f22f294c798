"""The rollout engines as the loop sees them: generate, sleep, refit; an engine lost is restarted, its call retried.

`EnginePool` owns everything about the engines' health: a call that fails because its engine died (kill -9, OOM,
or the health probe killed it: frozen or errored) restarts that engine on its bundle with the policy's current
weights and makes the call again (the step neither loses nor repeats a sample), up to deadlines.engine_restarts.

What differs between backends is a registry entry (`ENGINE_KINDS`, keyed by the schema's RolloutBackend), never
an `if` in the loop: whether the engines answer a health ping beside a stuck call (and so can be probed and
restarted), and how the policy's weights reach them (the refit strategy, chosen once, at the first refit):

    hybrid      rollout=hf colocated: each policy worker copies its weights into its own engine, on its device
    cuda_ipc    rollout=vllm on CUDA, engines on the policy's GPUs: device buffers shared over CUDA IPC, driven by
                policy rank 0 (rollout/vllm_compat.py)
    state_dict  separate engines: every policy rank joins (a sharded megatron model gathers collectively), rank 0
                returns the full HF-named dict (the others {}), one object-store copy feeds every engine

Async GRPO pushes versioned weights its own way (train/async_loop.py) through the same engines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import ray

from ..deadlines import HEALTH_GROUP, ActorDied, EngineLost, Hung
from ..envs.prompting import encode_prompts
from ..spec.schema import RolloutBackend, RunSpec
from ..tracking import metric_names as M

if TYPE_CHECKING:
    from ..plan import Plan
    from .workers import Workers

Refit = Callable[["EnginePool"], dict[str, float]]  # the refit's parts, ms by name (time/refit_<name>_ms)


class EnginePool:
    def __init__(self, spec: RunSpec, plan: Plan, workers: Workers, tok: Any) -> None:
        self.spec, self.plan, self.w, self.tok = spec, plan, workers, tok
        self.kind = ENGINE_KINDS[spec.rollout.backend]
        self.restarts = 0  # engines lost and started again (deadlines.engine_restarts)
        self._refit: Refit | None = None  # chosen at the first refit (it may ask an engine what it supports)
        self.refit_parts: dict[str, float] = {}  # the last refit's parts (metrics)

    # ------------------------------------------------------------------ generate
    def calls(self, prompts: list, seed: int) -> list[tuple[list, int]]:
        """(token ids, seed) of the call on engine i, for the first len() engines (those with prompts)."""
        ids = encode_prompts(self.tok, prompts, self.spec.env)  # env.chat_template / system_prompt; same for hf and vllm
        per = -(-len(ids) // len(self.w.rollout))
        return [(ids[i * per:(i + 1) * per], seed + i) for i in range(len(self.w.rollout)) if ids[i * per:(i + 1) * per]]

    def submit(self, prompts: list, n: int, seed: int, method: str = "generate") -> list:
        """The prompts split over the engines, one call each (`method` of the engine); the calls' ObjectRefs
        (call i on engine i: the first len(refs) engines)."""
        return [getattr(self.w.rollout[e], method).remote(ids, n, s) for e, (ids, s) in enumerate(self.calls(prompts, seed))]

    def generate(self, prompts: list, n: int, seed: int) -> list:
        """A lost engine is restarted (recover) and its call made again with the same prompts and seed."""
        calls = self.calls(prompts, seed)
        refs = [self.w.rollout[e].generate.remote(ids, n, s) for e, (ids, s) in enumerate(calls)]
        while True:
            try:
                return [g for part in self.w.get("generate", refs, self.w.rollout[:len(refs)]) for g in part]
            except ActorDied as exc:
                e = self.recover(exc)
            except ray.exceptions.RayTaskError as err:  # an engine's own error: lost if its ping fails too
                e = self.recover(self.dead_engine(err, "generate"))
            refs[e] = self.w.rollout[e].generate.remote(calls[e][0], n, calls[e][1])

    def sleep(self) -> tuple[float, float]:
        """rollout.sleep_mode: the engines free their GPU memory for the policy until the refit. (GiB freed, the
        most GiB one engine's workers still hold asleep)."""
        both = self.w.get("sleep", [e.sleep.remote() for e in self.w.rollout], self.w.rollout)
        return float(sum(freed for freed, _ in both)), float(max(held for _, held in both))

    def metrics(self) -> dict[str, float]:
        """rollout/engine_restarts where engines can be restarted (a health-probed kind on engines of their own)."""
        restartable = self.w.new_engine is not None and self.kind.health_probe
        parts = {f"{M.TIME_PREFIX}refit_{name}_ms": ms for name, ms in self.refit_parts.items()}
        return {**parts, M.ROLLOUT_ENGINE_RESTARTS: float(self.restarts)} if restartable else parts

    # ------------------------------------------------------------------ refit
    def refit(self) -> float:
        """Policy weights → every rollout engine (the strategy chosen once, by ENGINE_KINDS). Returns ms; the
        parts in refit_parts."""
        t0 = time.perf_counter()
        if self._refit is None:
            self._refit = self.kind.choose_refit(self)
        self.refit_parts = self._refit(self)
        return (time.perf_counter() - t0) * 1e3

    def weights(self) -> list:
        """Every policy rank's state_dict call (rank 0's holds the HF-named weights), waited for: a stuck policy
        rank is named as such, not as an engine."""
        refs = [p.state_dict.remote() for p in self.w.policy]
        self.w.clock.wait_all("state_dict", refs, self.w.policy)
        return refs

    # ------------------------------------------------------------------ health
    def dead_engine(self, err: Exception, phase: str) -> ActorDied:
        """An engine call raised: the engine whose own health ping fails too (its EngineCore process died: vLLM's
        EngineDeadError; or it does not answer) is lost as a dead actor is; else `err` stands (raised again)."""
        if self.w.probe is None or self.w.new_engine is None:  # no health group to ask, or nothing to restart
            raise err
        for e in self.w.rollout:
            try:
                ray.get(e.ping.options(concurrency_group=HEALTH_GROUP).remote(),
                        timeout=self.spec.deadlines.health_timeout_s)
            except Exception:  # noqa: BLE001  (dead, errored or silent: this engine is the one)
                reason = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
                return ActorDied(self.w.clock.prefix + phase, self.w.clock.step, e, reason)
        raise err

    def recover(self, exc: ActorDied) -> int:
        """A rollout engine lost (kill -9, OOM, or killed by the health probe: frozen or errored) is started again on
        its bundle and given the policy's current weights (those of its last refit); returns its index. Another
        actor's death is raised on; so is a loss past deadlines.engine_restarts (EngineLost: exit 4 naming it)."""
        w, cap = self.w, self.spec.deadlines.engine_restarts
        if w.new_engine is None or not any(exc.owner is r for r in w.rollout):
            raise exc
        e = next(i for i, r in enumerate(w.rollout) if r is exc.owner)
        why = (w.probe.why(exc.owner) if w.probe else None) or str(exc).split(": ", 1)[-1].rstrip(".")
        if self.restarts >= cap:
            raise EngineLost(exc.phase, exc.step, exc.owner, why, cap) from exc
        (old,) = w.describe([exc.owner])
        if w.probe is not None:
            w.probe.watched = [r for r in w.rollout if r is not exc.owner]
        new = w.restart_engine(e)
        state = self.weights()
        w.get("engine_restart", [new.update_weights.remote(state[0])], [new])  # its first wait: deadlines.first_s
        self.restarts += 1
        if w.probe is not None:
            w.probe.watched = list(w.rollout)
        print(f"grpo-launcher: rollout engine {e} (pid {old.pid}, node {old.node}) lost in phase {exc.phase} of step "
              f"{exc.step}: {why}; restarted ({self.restarts} of deadlines.engine_restarts={cap}) with the "
              "policy's current weights, its requests retried", flush=True)
        return e

    def engine_at_fault(self, exc: Hung | ActorDied) -> Hung | ActorDied:
        """The IPC refit's wait, past its deadline or failed, as the engines' fault where an engine does not answer
        its health ping (frozen: Hung naming it) or is dead (ActorDied naming it); else `exc` (the policy's)."""
        if self.w.probe is None:  # no "health" concurrency group: a ping would queue behind the stuck refit call
            return exc
        refs = [e.ping.options(concurrency_group=HEALTH_GROUP).remote() for e in self.w.rollout]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.spec.deadlines.health_timeout_s)
        frozen = [e for e, r in zip(self.w.rollout, refs) if r in pending]
        if frozen:
            return Hung(exc.phase, exc.step, getattr(exc, "waited", 0.0),
                        "policy rank 0 waits on the engines' refit; they give no health answer", frozen)
        for e, r in zip(self.w.rollout, refs):
            try:
                ray.get(r)
            except Exception as err:  # noqa: BLE001  (dead or errored: this engine is the one)
                return ActorDied(exc.phase, exc.step, e, str(err).strip().splitlines()[0][:200])
        return exc


# ---------------------------------------------------------------------- refit strategies
def refit_hybrid(pool: EnginePool) -> dict[str, float]:
    """rollout=hf colocated: each policy worker copies its weights into its own engine, on its device."""
    w = pool.w
    ms = max(w.get("refit", [p.refit_engine.remote() for p in w.policy], w.policy))
    return {"engine": ms} if ms else {}  # 0: the engine shares the policy's model (nothing copied)


def refit_cuda_ipc(pool: EnginePool) -> dict[str, float]:
    """vLLM on CUDA, engines on the policy's GPUs: policy rank 0 drives them; a failed or overdue wait is named as
    the engine's fault where an engine is frozen or dead (engine_at_fault)."""
    w = pool.w
    try:
        return w.get("refit", [p.send_weights_ipc.remote(w.rollout) for p in w.policy], w.policy)[0]  # rank 0's
    except (Hung, ActorDied) as exc:
        raise pool.engine_at_fault(exc) from exc


def refit_state_dict(pool: EnginePool) -> dict[str, float]:
    """Rank 0's HF-named dict, one object-store copy for every engine; an engine lost meanwhile is restarted with
    these weights (recover), the others' pushes waited for."""
    w = pool.w
    refs = [p.state_dict.remote() for p in w.policy]
    pushes = dict(enumerate(r.update_weights.remote(refs[0]) for r in w.rollout))
    w.clock.wait_all("state_dict", refs, w.policy)  # a stuck policy rank is named as such
    while True:
        try:
            loaded = w.get("refit", list(pushes.values()), [w.rollout[e] for e in pushes])
            break
        except ActorDied as exc:
            pushes.pop(pool.recover(exc))  # restarted with these weights
        except ray.exceptions.RayTaskError as err:
            pushes.pop(pool.recover(pool.dead_engine(err, "refit")))
    if w.probe is not None:
        w.probe.watched = list(w.rollout)  # up and refit: probed from now on
    return {"engine": max(loaded, default=0.0)}  # every engine restarted meanwhile: loaded as it started


def hf_refit(pool: EnginePool) -> Refit:
    return refit_hybrid if pool.plan.hybrid_rollout else refit_state_dict


def vllm_refit(pool: EnginePool) -> Refit:
    """CUDA IPC where the engines sit on the policy's GPUs and this vLLM supports it (asked once, its own phase:
    not the refits' history); else the state dict."""
    w, plan = pool.w, pool.plan
    ipc = plan.use_gpus and not plan.rollout_devices and w.get(
        "refit_probe", [w.rollout[0].supports_ipc_refit.remote()], w.rollout[:1])[0]
    return refit_cuda_ipc if ipc else refit_state_dict


@dataclass(frozen=True)
class EngineKind:
    health_probe: bool  # answers `ping` in a "health" concurrency group beside a stuck call: probed, restartable
    choose_refit: Callable[[EnginePool], Refit]


ENGINE_KINDS: dict[RolloutBackend, EngineKind] = {
    RolloutBackend.vllm: EngineKind(health_probe=True, choose_refit=vllm_refit),
    RolloutBackend.hf: EngineKind(health_probe=False, choose_refit=hf_refit),
}
