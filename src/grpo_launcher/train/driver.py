"""The GRPO driver: rollout → score → advantages → logprobs → update → refit → log, over Ray actors.

    python -m grpo_launcher.train.driver RUN_DIR/spec.yaml      (what the sbatch script runs)
    grpo_launcher.train.driver.run(spec, plan)                   (what cluster=local calls)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import ray
import torch

from .. import algos
from ..exit_codes import ExitCode
from ..plan import Plan, make_plan, parse_duration
from ..spec.schema import EnvName, RunSpec
from ..tracking import metric_names as M
from ..batch import Generation, TrainBatch, collate, shard_rows
from ..envs.rewards import Scored
from ..deadlines import HEALTH_GROUP, ActorDied, EngineLost, Hung, hang_report, stack_on_node
from .loop_state import LoopState, StopRequest
from .startup import StartupClock, process_start, quiet_libraries
from .workers import Workers, create_workers, ray_session


def run(spec: RunSpec, plan: Plan, t_start: float | None = None) -> int:
    stop = StopRequest.install(spec.deadlines.stop_grace_s)  # first: Slurm's SIGUSR1 in start-up must not kill it
    clock = StartupClock(t_start or process_start())  # where the time before step 1 went (train/startup.py)
    quiet_libraries()
    from ..envs import EnvNotAvailable, UserCodeError, make_env
    from ..tracking.report import finish_run, user_code_failed
    from .setup import prepare_model, resume_or_start

    try:  # env=nemo_gym: envs.LAZY_ENVS imports grpo_launcher/gym on first use
        clock.mark("imports")
        env = make_env(spec)
    except (EnvNotAvailable, UserCodeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    clock.mark("env")
    model_dir = prepare_model(spec, plan, env)
    clock.mark("model")
    with ray_session(spec, plan):
        stop.reinstall()  # ray.init() replaced the SIGTERM handler with Ray's (which exits without saving)
        clock.mark("ray")
        workers = create_workers(spec, plan, str(model_dir))  # they import and load while the driver sets up
        clock.mark("workers started")
        trainer = state = None
        try:
            state = resume_or_start(spec, plan)  # checkpoint + MLflow run
            if state is None:
                return ExitCode.CONFIG_ERROR
            clock.mark("mlflow" if spec.logging.mlflow else "checkpoints")
            from ..tracking.repro import record_launch

            record_launch(spec, plan, state)  # RUN_DIR/repro/: git commit, uncommitted diff, pip freeze (+ MLflow)
            clock.mark("repro")
            trainer = trainer_class(spec)(spec, plan, env, workers, state, stop, model_dir)
            clock.mark("tokenizer")
            workers.ready()
            clock.mark("workers ready")
            publish_rollout_endpoints(spec, plan, workers)
            trainer.clock = clock
            return finish_run(spec, plan, state, trainer.train())  # + where everything is, the curve PNG
        except UserCodeError as exc:  # a reward fn / Env / prompt failed: named with its row; progress kept
            return user_code_failed(exc, trainer, state)
        except Hung as exc:  # a wait passed its deadline: named, stacks taken, then the actors are killed (finally)
            return report_hang(exc, workers, state)
        except ActorDied as exc:  # kill -9, OOM, a crash: named with the last step and checkpoint
            return report_died(exc, workers, state)
        except SystemExit as exc:  # a stop abandoned the step (a second signal, or deadlines.stop_grace_s passed)
            if state is not None:
                state.abort()  # the last checkpoint stands
            if stop.requested:  # its own code: Ray's get turns a handler's SystemExit(143) into SystemExit(1)
                return stop.exit_code
            return exc.code if isinstance(exc.code, int) else ExitCode.FAILED
        except BaseException:
            if state is not None:
                state.abort()  # metrics after the last checkpoint are dropped: a resume logs those steps again
            raise
        finally:
            stop.step_done()  # a stop's grace timer never outlives the run (in-process sweeps, tests)
            workers.shutdown()
            (plan.run_dir / "rollout_endpoints.json").unlink(missing_ok=True)  # its URLs die with the engines


def report_hang(exc: Hung, workers: Workers, state: LoopState | None) -> int:
    """The hang message (phase, actors, last step and checkpoint, stacks) on stderr; RUN_DIR/phase.json says HUNG
    (the launcher's status.json takes it: launch/status.py); the MLflow run FAILED with tag grpo.hung."""
    ckpt = state.ckpt.latest() if state is not None else None
    last = state.step if state is not None else 0
    actors = getattr(exc, "actors", None) or workers.describe(exc.owners)  # a Gym server comes described
    taken = getattr(exc, "stack", None)  # ... with its stack, taken when it was found
    print(hang_report(exc, actors, last, str(ckpt) if ckpt else "none",
                      stack=(lambda _: taken) if taken else stack_on_node), file=sys.stderr, flush=True)
    workers.clock.mark_hung(str(exc))
    workers.stuck = list(exc.owners)  # killed at shutdown without waiting for them
    if state is not None:
        if state.tracker is not None:
            state.tracker.set_tag("grpo.hung", str(exc))
        state.abort()  # metrics after the last checkpoint dropped, the run FAILED (as any failure)
    return ExitCode.HUNG


def report_died(exc: ActorDied, workers: Workers, state: LoopState | None) -> int:
    """An actor died mid-wait: which one (role, rank, pid, node), in which phase, the last step and checkpoint."""
    (a,) = workers.describe([exc.owner]) if exc.owner is not None else [None]
    who = f"{a.role} rank {a.rank} (pid {a.pid}, node {a.node})" if a else "an actor"
    ckpt = state.ckpt.latest() if state is not None else None
    print(f"grpo-launcher: {who} {exc}\n  last completed step: {state.step if state else 0}; last checkpoint: "
          f"{ckpt or 'none'}; resume starts from it", file=sys.stderr, flush=True)
    workers.stuck = [exc.owner]
    if state is not None:
        if state.tracker is not None:
            state.tracker.set_tag("grpo.actor_died", f"{who} {exc}"[:500])
        state.abort()
    return ExitCode.FAILED


def trainer_class(spec: RunSpec) -> type:
    """The loop: Trainer, or for env=nemo_gym GymTrainer (Gym's servers around it, rollouts through its agents),
    or with grpo.async_grpo.enabled AsyncTrainer (generation overlaps the update; train/async_loop.py)."""
    if spec.env.name == EnvName.nemo_gym:
        from .gym_loop import GymTrainer

        return GymTrainer
    if spec.grpo.async_grpo.enabled:
        from .async_loop import AsyncTrainer

        return AsyncTrainer
    return Trainer


def publish_rollout_endpoints(spec: RunSpec, plan: Plan, workers: Workers) -> None:
    """rollout.expose_http_server: every engine's OpenAI base URL → RUN_DIR/rollout_endpoints.json (and the log)."""
    if not spec.rollout.expose_http_server:
        return
    import json

    from ..runfiles import write_atomic

    urls = workers.get("endpoints", [r.http_url.remote() for r in workers.rollout], workers.rollout)
    write_atomic(plan.run_dir / "rollout_endpoints.json",  # 0600: it holds the servers' API key
                 json.dumps({"model": spec.model.name, "base_urls": urls, "api_key": spec.rollout.http_api_key or None},
                            indent=1) + "\n", mode=0o600)
    print(f"grpo-launcher: rollout endpoints {' '.join(urls)}", flush=True)


class Trainer:
    clock: "StartupClock | None" = None  # set by run(): the start-up line after this process's first step

    def __init__(self, spec: RunSpec, plan: Plan, env, workers: Workers, state: LoopState, stop: StopRequest,
                 model_dir: Path):
        self.spec, self.plan, self.env, self.w, self.state, self.stop = spec, plan, env, workers, state, stop
        self.tok = workers.get("load_tokenizer", [workers.policy[0].load_tokenizer.remote()],  # policy/hybrid.py:
                               workers.policy[:1])[0]  # why not AutoTokenizer
        from ..envs.prompting import split_prompts
        from ..tracking.report import write_prompting

        write_prompting(plan.run_dir, self.tok, spec.env, state.data_log, model_dir,  # chat template, system prompt,
                        split_prompts(env, plan.prompts_per_step))  # each split's first prompt as rendered
        self.scored: dict[int, Scored] = {}  # id(Generation) → its Scored, until the step takes it
        self.engine_restarts = 0  # rollout engines lost and started again (deadlines.engine_restarts)
        self.deadline = (time.monotonic() + parse_duration(spec.checkpoint.must_save_by)
                         if spec.checkpoint.must_save_by else None)

    # ------------------------------------------------------------------ the loop
    def train(self) -> int:
        s, st = self.spec, self.state
        if st.checkpoint_path is not None:
            self.w.get("load", [p.load.remote(str(st.checkpoint_path)) for p in self.w.policy], self.w.policy)
        self.refit()  # engines may start with dummy weights: the policy's are pushed before any rollout
        if st.checkpoint_path is None and s.grpo.val_at_start:
            st.log(0, self.validate())
        progress = st.progress_bar(s.grpo.max_steps)
        for step in range(st.step + 1, s.grpo.max_steps + 1):
            self.w.clock.step = step
            metrics = self.profiled_step(step) if step == s.logging.profile_step else self.step(step)
            if self.clock is not None:
                self.clock.mark("step 1")
                print(self.clock.report(), flush=True)
                self.clock = None
            if s.grpo.val_period and step % s.grpo.val_period == 0 or (step == s.grpo.max_steps and s.grpo.val_at_end):
                metrics.update(self.validate())
            st.log(step, metrics)
            append_metrics(self.plan.run_dir / "metrics.jsonl", step, metrics)
            progress.update(step, metrics)
            last = step == s.grpo.max_steps
            stopping = self.stop.requested or (self.deadline is not None and time.monotonic() > self.deadline)
            if stopping:
                self.stop.step_done()  # the step finished within deadlines.stop_grace_s: no abandoning now
            if last or stopping or (s.checkpoint.enabled and step % s.checkpoint.save_period == 0):
                self.save(step, metrics)
            if stopping and not last:
                progress.close()
                print(f"grpo-launcher: stopped after step {step} ({self.stop.reason or 'must_save_by'}); "
                      "checkpoint saved", flush=True)
                st.finish("KILLED")
                return ExitCode.REQUEUE if self.stop.requeue or self.deadline else self.stop.exit_code
        progress.close()
        st.finish("FINISHED")
        return 0

    def profiled_step(self, step: int) -> dict[str, float]:
        """logging.profile_step: this step's phases on every policy worker under torch.profiler."""
        from ..policy.profile import summary_line

        where = self.plan.run_dir / "profile" / f"step_{step}"
        self.w.get("profile", [p.start_profile.remote(str(where)) for p in self.w.policy], self.w.policy)
        metrics = self.step(step)
        phases = self.w.get("profile", [p.stop_profile.remote() for p in self.w.policy], self.w.policy)
        print(f"grpo-launcher: profile of step {step} (rank 0; all ranks in {where}): {summary_line(phases[0])}",
              flush=True)
        return metrics

    def step(self, step: int) -> dict[str, float]:
        t = Timer()
        gens, prompts, rewards, rounds = self.rollout_and_score(step, t)
        if self.plan.engine_sleeps:  # rollout.sleep_mode: the GPU memory is the policy's until the refit
            with t("sleep"):
                freed = self.w.get("sleep", [e.sleep.remote() for e in self.w.rollout], self.w.rollout)
        pipeline = self.pipeline_metrics(step, t)  # buffer depth, sample ages, idle times: sync and async alike
        batch, m = self.make_batch(gens, rewards)
        scored, reward_parts = self.take_scored(gens, "train")
        m.update(reward_parts)
        if not self.plan.logprobs_from_update:  # else the update's own forward gives them (on-policy)
            with t("logprobs"):
                batch = self.compute_logprobs(batch)
        with t("update"):
            batch, update_metrics = self.update(batch)
            m.update(update_metrics)
        with t("refit"):
            m[M.TIME_REFIT_MS] = self.refit()
        with t("log"):
            self.state.train_data(step, prompts, gens, rewards, batch, self.tok, self.sample_versions(step, len(gens)),
                                  scored=scored)
        gen_tokens = int(batch.response_mask.sum())
        m.update(t.as_metrics(), **{M.TRAIN_DYNAMIC_SAMPLING_ROUNDS: rounds,
                                    M.TRAIN_TOKENS_PER_S: gen_tokens / max(self.generation_seconds(t), 1e-9)})
        m.update(pipeline)
        if self.plan.engine_sleeps:
            m[M.ROLLOUT_SLEEP_FREED_GIB] = float(sum(freed))
        if self.w.new_engine is not None and self.spec.rollout.backend.value == "vllm":  # restartable engines
            m[M.ROLLOUT_ENGINE_RESTARTS] = float(self.engine_restarts)
        if M.TIME_GENERATION_IDLE_S not in m:  # sync: the engines idle through everything but the rollout
            m[M.TIME_GENERATION_IDLE_S] = max(m[M.TIME_STEP_S] - t.seconds["rollout"], 0.0)
        return m

    # ------------------------------------------------------------------ the same metrics in sync and async
    def pipeline_metrics(self, step: int, t: Timer) -> dict[str, float]:
        """Sync: nothing is generated ahead (buffer depth 0, every sample from version step - 1, age 0); the
        trainer waits through the rollout. (AsyncTrainer reports its buffer's figures under the same keys.)"""
        return {M.BUFFER_DEPTH: 0.0, M.BUFFER_SAMPLE_AGE_MEAN: 0.0, M.BUFFER_SAMPLE_AGE_MAX: 0.0,
                M.TRAIN_POLICY_VERSION: float(step - 1), M.TIME_TRAINER_IDLE_S: t.seconds["rollout"]}

    def sample_versions(self, step: int, n: int) -> list[tuple[int, int]]:
        """The policy versions each of this step's samples was generated with, (first, last) (the train-data
        log's policy_version, policy_version_last; sync: the weights of step - 1)."""
        return [(step - 1, step - 1)] * n

    def generation_seconds(self, t: Timer) -> float:
        """Seconds the engines spent generating this step's batch (sync: the rollout phase)."""
        return t.seconds["rollout"]

    # ------------------------------------------------------------------ phases
    def generate(self, prompts: list, n: int, seed: int) -> list[Generation]:
        """A lost engine is restarted (recover) and its call made again with the same prompts and seed: the step
        neither loses nor repeats a sample."""
        calls = self.engine_calls(prompts, seed)
        refs = [self.w.rollout[e].generate.remote(ids, n, s) for e, (ids, s) in enumerate(calls)]
        while True:
            try:
                return [g for part in self.w.get("generate", refs, self.w.rollout[:len(refs)]) for g in part]
            except ActorDied as exc:
                e = self.recover(exc)
            except ray.exceptions.RayTaskError as err:  # an engine's own error: lost if its ping fails too
                e = self.recover(self.dead_engine(err, "generate"))
            refs[e] = self.w.rollout[e].generate.remote(calls[e][0], n, calls[e][1])

    def submit_generate(self, prompts: list, n: int, seed: int, method: str = "generate") -> list:
        """The prompts split over the engines, one call each (`method` of the engine); the calls' ObjectRefs
        (call i on engine i: the first len(refs) engines)."""
        return [getattr(self.w.rollout[e], method).remote(ids, n, s)
                for e, (ids, s) in enumerate(self.engine_calls(prompts, seed))]

    def engine_calls(self, prompts: list, seed: int) -> list[tuple[list, int]]:
        """(token ids, seed) of the call on engine i, for the first len() engines (those with prompts)."""
        from ..envs.prompting import encode_prompts

        ids = encode_prompts(self.tok, prompts, self.spec.env)  # env.chat_template / system_prompt; same for hf and vllm
        per = -(-len(ids) // len(self.w.rollout))
        return [(ids[i * per:(i + 1) * per], seed + i) for i in range(len(self.w.rollout)) if ids[i * per:(i + 1) * per]]

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
        if self.engine_restarts >= cap:
            raise EngineLost(exc.phase, exc.step, exc.owner, why, cap) from exc
        (old,) = w.describe([exc.owner])
        if w.probe is not None:
            w.probe.watched = [r for r in w.rollout if r is not exc.owner]
        new = w.restart_engine(e)
        state = [p.state_dict.remote() for p in w.policy]
        w.clock.wait_all("state_dict", state, w.policy)
        w.get("engine_restart", [new.update_weights.remote(state[0])], [new])  # its first wait: deadlines.first_s
        self.engine_restarts += 1
        if w.probe is not None:
            w.probe.watched = list(w.rollout)
        print(f"grpo-launcher: rollout engine {e} (pid {old.pid}, node {old.node}) lost in phase {exc.phase} of step "
              f"{exc.step}: {why}; restarted ({self.engine_restarts} of deadlines.engine_restarts={cap}) with the "
              "policy's current weights, its requests retried", flush=True)
        return e

    def train_seed(self, step: int, round_: int) -> int:
        """The sampling seed of a step's generation round (the same in sync and async)."""
        return (self.spec.grpo.seed * 1_000_003 + step * 101 + round_) % 2**31

    def score(self, prompts: list, gens: list[Generation], n: int) -> torch.Tensor:
        texts = [self.tok.decode(g.response_ids, skip_special_tokens=True) for g in gens]
        expanded = [p for p in prompts for _ in range(n)]
        scored = self.w.get("score", [self.w.env.score.remote(expanded, texts)], [self.w.env])[0]
        self.scored.update({id(g): s for g, s in zip(gens, scored)})  # per-function rewards: metrics, train data
        return torch.tensor([s.total for s in scored], dtype=torch.float32)

    def take_scored(self, gens: list[Generation], split: str) -> tuple[list[Scored | None], dict[str, float]]:
        """These samples' Scored (None: scored elsewhere, e.g. Gym) and their per-function reward metrics."""
        from ..envs.rewards import keep_first_error, reward_metrics

        scored, self.scored = [self.scored.get(id(g)) for g in gens], {}
        keep_first_error(self.plan.run_dir, scored)
        return scored, reward_metrics(split, scored)

    def rollout_and_score(self, step: int, t: "Timer"):
        """Generate and score; with dynamic sampling, keep only groups whose rewards vary (refill, capped)."""
        s = self.spec
        P, G = self.plan.prompts_per_step, self.plan.group_size
        rounds = s.loss.dynamic_sampling_max_rounds if s.loss.dynamic_sampling else 1
        kept: list[tuple] = []  # (prompt, gens of the group, rewards of the group)
        spare: list[tuple] = []
        for r in range(rounds):
            prompts = self.env.train_prompts(step, r, P)
            with t("rollout"):
                gens = self.generate(prompts, G, seed=self.train_seed(step, r))
            with t("score"):
                rewards = self.score(prompts, gens, G)
            varies = algos.nonzero_variance_groups(rewards, G) if s.loss.dynamic_sampling else torch.ones(P, dtype=torch.bool)
            for k, p in enumerate(prompts):
                group = (p, gens[k * G:(k + 1) * G], rewards[k * G:(k + 1) * G])
                (kept if varies[k] else spare).append(group)
            if len(kept) >= P:
                break
        groups = (kept + spare)[:P]  # short of varied groups after the cap: pad with zero-advantage ones
        prompts = [g[0] for g in groups]
        gens = [x for g in groups for x in g[1]]
        return gens, prompts, torch.cat([g[2] for g in groups]), r + 1

    def make_batch(self, gens: list[Generation], rewards: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]:
        s = self.spec
        G = self.plan.group_size
        adv = algos.compute_advantages(s.loss.advantage, rewards, G)  # [B] over ALL samples
        truncated = torch.tensor([g.truncated for g in gens])
        sample_mask = algos.overlong_sample_mask(truncated) if s.loss.overlong_filtering else torch.ones(len(gens))
        batch = collate(gens, adv, sample_mask, self.tok.pad_token_id)
        lens = batch.response_mask.sum(-1)
        m = {M.TRAIN_REWARD_MEAN: float(rewards.mean()), M.TRAIN_REWARD_STD: float(rewards.std()),
             M.TRAIN_ACCURACY: float((rewards >= 1).float().mean()), M.TRAIN_ADV_MEAN: float(adv.mean()),
             M.TRAIN_ADV_STD: float(adv.std()), M.TRAIN_ADV_ABS_MAX: float(adv.abs().max()),
             M.TRAIN_GEN_LEN_MEAN: float(lens.mean()), M.TRAIN_TRUNCATION_RATE: float(truncated.float().mean())}
        return batch, m

    def compute_logprobs(self, batch: TrainBatch) -> TrainBatch:
        dp = self.plan.policy_ranks
        parts = self.w.get("logprobs", [p.logprobs.remote(batch.select(shard_rows(len(batch), dp, i)))
                                        for i, p in enumerate(self.w.policy)], self.w.policy)
        prev = torch.cat([a for a, _ in parts])
        ref = torch.cat([b for _, b in parts]) if parts[0][1] is not None else None
        lo = self.spec.loss
        isw = None
        if lo.importance_sampling_correction:
            isw = algos.is_correction_weights(prev, batch.generation_logprobs, batch.response_mask,
                                              mode=lo.is_truncation, threshold=lo.is_threshold,
                                              low=lo.is_threshold_low)
        return batch.with_(prev_logprobs=prev, ref_logprobs=ref, is_weights=isw)

    def update(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """One optimizer step per minibatch over the DP ranks. Returns the batch (with the old logprobs
        the update itself computed, when the plan takes them from it) and the summed metrics."""
        from ..algos.loss import local_denominator

        gbs, dp = self.plan.minibatch_size, self.plan.policy_ranks
        minibatches = [batch.select(slice(i, i + gbs)) for i in range(0, len(batch), gbs)]
        agg = self.spec.loss.aggregation
        # global denominators; 0 = no loss-bearing sample in the minibatch: every rank skips its step
        dens = [local_denominator(agg, algos.loss_mask(mb.response_mask, mb.sample_mask)) for mb in minibatches]
        results = self.w.get("update", [p.update.remote([mb.select(shard_rows(len(mb), dp, r)) for mb in minibatches],
                                                        dens) for r, p in enumerate(self.w.policy)], self.w.policy)
        if self.plan.logprobs_from_update:  # rank r returned the old logprobs of its shard
            ref = [res.pop("ref_logprobs") for res in results]
            batch = batch.with_(prev_logprobs=torch.cat([res.pop("prev_logprobs") for res in results]),
                                ref_logprobs=torch.cat(ref) if ref[0] is not None else None)
        first = ("grad_norm", "lr", "skipped_optimizer_steps")  # the same on every rank
        keys = {k for res in results for k in res if k not in first}
        out = {M.TRAIN_PREFIX + k: (max if algos.METRIC_REDUCTIONS.get(k) == "max" else sum)(res[k] for res in results if k in res)
               for k in keys}  # ranks' weighted means add up; maxima stay maxima
        out.update({M.TRAIN_GRAD_NORM: results[0]["grad_norm"], M.TRAIN_LR: results[0]["lr"],
                    M.TRAIN_SKIPPED_OPTIMIZER_STEPS: results[0]["skipped_optimizer_steps"],
                    M.TRAIN_LOGPROBS_FROM_UPDATE: float(self.plan.logprobs_from_update)})
        diff = (batch.prev_logprobs - batch.generation_logprobs).abs() * batch.response_mask
        out[M.TRAIN_GEN_VS_POLICY_LOGPROB_ABSDIFF] = float(diff.sum() / batch.response_mask.sum().clamp(min=1))
        return batch, out

    def refit(self) -> float:
        """Policy weights → every rollout engine. Returns ms.

        Hybrid (rollout=hf): each policy worker copies its weights into its own engine, on its device.
        Separate engines (vLLM): every policy rank joins (a sharded megatron model gathers collectively),
        rank 0 returns the full HF-named dict (the others {}), one object-store copy feeds every engine.
        """
        t0 = time.perf_counter()
        if self.plan.hybrid_rollout:
            self.w.get("refit", [p.refit_engine.remote() for p in self.w.policy], self.w.policy)
            return (time.perf_counter() - t0) * 1e3
        if self._ipc_refit():  # vLLM on CUDA, engines on the policy's GPUs: device buffers shared over CUDA IPC
            try:
                self.w.get("refit", [p.send_weights_ipc.remote(self.w.rollout) for p in self.w.policy], self.w.policy)
            except (Hung, ActorDied) as exc:  # policy rank 0 drives the engines: name the engine it waited on
                raise self.engine_at_fault(exc) from exc
            return (time.perf_counter() - t0) * 1e3
        refs = [p.state_dict.remote() for p in self.w.policy]
        pushes = dict(enumerate(r.update_weights.remote(refs[0]) for r in self.w.rollout))
        self.w.clock.wait_all("state_dict", refs, self.w.policy)  # a stuck policy rank is named as such
        while True:
            try:
                self.w.get("refit", list(pushes.values()), [self.w.rollout[e] for e in pushes])
                break
            except ActorDied as exc:
                pushes.pop(self.recover(exc))  # restarted with these weights
            except ray.exceptions.RayTaskError as err:
                pushes.pop(self.recover(self.dead_engine(err, "refit")))
        if self.w.probe is not None:
            self.w.probe.watched = list(self.w.rollout)  # up and refit: probed from now on
        return (time.perf_counter() - t0) * 1e3

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

    def _ipc_refit(self) -> bool:
        """Whether the engines take the weights over CUDA IPC (rollout/vllm_compat.py): GPUs, colocated engines
        (each on a GPU where a policy rank holds the full weights), and an engine whose vLLM supports it."""
        if not hasattr(self, "_ipc"):
            self._ipc = bool(self.plan.use_gpus and not self.plan.rollout_devices
                             and self.spec.rollout.backend.value == "vllm"
                             and self.w.get("refit_probe", [self.w.rollout[0].supports_ipc_refit.remote()],
                                            self.w.rollout[:1])[0])  # its own phase: not the refits' history
        return self._ipc

    def validate(self) -> dict[str, float]:
        g = self.spec.grpo
        prompts = self.env.val_prompts()
        prompts = prompts if g.max_val_samples is None else prompts[: g.max_val_samples]  # null = all
        rewards, all_gens = [], []
        self.w.clock.prefix = "val_"  # its waits have a history of their own (val_generate, val_score)
        try:
            for i in range(0, len(prompts), g.val_batch_size):  # a last partial batch is still validated
                chunk = prompts[i:i + g.val_batch_size]
                gens = self.generate(chunk, 1, seed=1234 + i)
                rewards.append(self.score(chunk, gens, 1))
                all_gens += gens
        finally:
            self.w.clock.prefix = ""
        r = torch.cat(rewards)
        return {M.VAL_REWARD_MEAN: float(r.mean()), M.VAL_ACCURACY: float((r >= 1).float().mean()),
                M.VAL_SAMPLES: float(len(r)), **self.take_scored(all_gens, "val")[1]}

    def save(self, step: int, metrics: dict[str, float]) -> None:
        def write(tmp: Path) -> None:
            self.w.get("save", [p.save.remote(str(tmp)) for p in self.w.policy], self.w.policy)

        self.state.save_checkpoint(step, write, metrics)


def append_metrics(path: Path, step: int, metrics: dict[str, float]) -> None:
    """One JSON line per step (with or without MLflow): what benchmarks and scripts read. A resumed run first
    drops the lines after its checkpoint's step (train/setup.py trim_metrics): one line per step."""
    import json

    with open(path, "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")


class Timer:
    """Accumulates wall time per named phase: `with t("rollout"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"rollout": 0.0}
        self._t0 = time.perf_counter()

    def __call__(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t

        return _Phase()

    def as_metrics(self) -> dict[str, float]:
        out = {f"{M.TIME_PREFIX}{k}_s": v for k, v in self.seconds.items()}
        out[M.TIME_STEP_S] = time.perf_counter() - self._t0
        return out


def main() -> None:
    from ..runfiles import load_spec_file

    spec = load_spec_file(Path(sys.argv[1]))
    sys.exit(run(spec, make_plan(spec)))


if __name__ == "__main__":
    main()
