"""The GRPO driver: rollout → score → advantages → logprobs → update → refit → log, over Ray actors.

    python -m grpo_launcher.train.driver RUN_DIR/spec.yaml      (what the sbatch script runs)
    grpo_launcher.train.driver.run(spec, plan)                   (what cluster=local calls)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import algos
from ..algos.loss import local_denominator
from ..batch import Generation, TrainBatch, shard_rows
from ..deadlines import ActorDied, Hung, hang_report, stack_on_node
from ..disk_full import report as disk_full_report
from ..envs import EnvNotAvailable, UserCodeError, make_env
from ..envs.prompting import split_prompts
from ..envs.rewards import keep_first_error, reward_metrics
from ..exit_codes import ExitCode
from ..plan import Plan, make_plan, parse_duration
from ..policy.profile import summary_line
from ..policy.update_log import Diverged
from ..preflight import memory_estimate as memory
from ..runfiles import append_line, load_spec_file, write_atomic
from ..spec.errors import ConfigError
from ..spec.schema import LossSpec, RunSpec, validation_on
from ..tracking import metric_names as M
from ..tracking.gpu_memory import GpuPeak
from ..tracking.report import diverged, finish_run, user_code_failed, write_prompting
from ..tracking.repro import record_launch
from .async_loop import AsyncSource
from .engines import EnginePool
from .loop_state import LoopState, StopRequest
from .setup import prepare_model, resume_or_start
from .sources import RolloutSource, SyncSource, Timer, reward_summary
from .startup import Readiness, StartupClock, prefetch_tokenizer_imports, process_start, quiet_libraries
from .workers import Workers, create_workers, ray_session, ray_temp_problem


def run(spec: RunSpec, plan: Plan, t_start: float | None = None, pending: Sequence[int] = ()) -> int:
    """`pending`: stop signals the caller held while this module loaded (launch/local.py signals_held)."""
    stop = StopRequest.install(spec.deadlines.stop_grace_s, pending, saves=spec.checkpoint.enabled)  # first: a SIGUSR1 in start-up must not kill it
    clock = StartupClock(t_start or process_start())  # where the time before step 1 went (train/startup.py)
    quiet_libraries()
    try:  # env=nemo_gym: envs.LAZY_ENVS imports grpo_launcher/gym on first use
        clock.mark("imports")
        env = make_env(spec)
    except (EnvNotAvailable, UserCodeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    clock.mark("env")
    predicted = memory.estimate(spec).peak_gib if spec.cluster.gpus_per_node else None
    gpu_peak = GpuPeak.start(spec.cluster.gpus_per_node, predicted)  # before this process or a worker uses a GPU
    model_dir = prepare_model(spec, plan, env)
    clock.mark("model")
    if (problem := ray_temp_problem(spec)) is not None:  # nothing started yet: one message, not ray.init's traceback
        print(f"error: {problem}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    with ray_session(spec, plan, keep_sigterm=True):  # a SIGTERM while Ray starts is a stop, as after
        stop.reinstall()  # ray.init() replaced the SIGTERM handler with Ray's (which exits without saving)
        clock.mark("ray")
        workers = create_workers(spec, plan, str(model_dir))  # they import and load while the driver sets up
        clock.mark("workers started")
        started = Readiness(workers)  # each actor's start-up report, queued behind its __init__
        trainer = state = None
        try:
            state = resume_or_start(spec, plan)  # checkpoint + MLflow run
            if state is None:
                return ExitCode.CONFIG_ERROR
            state.gpu_peak = gpu_peak  # its figures go into summary.json and the MLflow run at the end
            clock.mark("mlflow" if spec.logging.mlflow else "checkpoints")
            record_launch(spec, plan, state)  # RUN_DIR/repro/: git commit, uncommitted diff, pip freeze (+ MLflow)
            clock.mark("repro")
            imports = prefetch_tokenizer_imports()  # while the driver waits for the policy workers
            started.wait(workers, "policy", clock)  # "policy ready": the tokenizer and the process group need them
            imports.join()
            trainer = Trainer(spec, plan, env, workers, state, stop, model_dir, source_class(spec, env))
            clock.mark("tokenizer")
            workers.ready()
            clock.mark("process group")
            started.wait(workers, "engines", clock)  # separate engines: started beside the policy's load
            publish_rollout_endpoints(spec, plan, workers)
            trainer.clock = clock
            return finish_run(spec, plan, state, trainer.train())  # + where everything is, the curve PNG
        except UserCodeError as exc:  # a reward fn / Env / prompt failed: named with its row; progress kept
            return user_code_failed(exc, trainer, state)
        except Diverged as exc:  # NaN/inf gradients (a worker's, through Ray) or logprobs: no checkpoint of them
            return diverged(exc, state)
        except Hung as exc:  # a wait passed its deadline: named, stacks taken, then the actors are killed (finally)
            return report_hang(exc, workers, state)
        except ActorDied as exc:  # kill -9, OOM, a crash: named with the last step and checkpoint
            return report_died(exc, workers, state, model_dir)
        except SystemExit as exc:  # a stop abandoned the step (a second signal, or deadlines.stop_grace_s passed)
            if state is not None:
                state.abort()  # the last checkpoint stands
            if stop.requested:  # its own code: Ray's get turns a handler's SystemExit(143) into SystemExit(1)
                return stop.exit_code
            return exc.code if isinstance(exc.code, int) else ExitCode.FAILED
        except BaseException as exc:
            full = disk_full_report(exc, state, plan.run_dir)  # a full disk: one message, the MLflow run ended
            if full is not None:
                return full
            if state is not None:
                state.abort()  # metrics after the last checkpoint are dropped: a resume logs those steps again
            raise
        finally:
            gpu_peak.stop()
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


def report_died(exc: ActorDied, workers: Workers, state: LoopState | None, model_dir: Path | None = None) -> int:
    """An actor died mid-wait: which one (role, rank, pid, node), in which phase, the last step and checkpoint; and
    a model dir deleted or moved since the launch, named (the worker's own error reads 'Repo id must be ...')."""
    (a,) = workers.describe([exc.owner]) if exc.owner is not None else [None]
    who = f"{a.role} rank {a.rank} (pid {a.pid}, node {a.node})" if a else "an actor"
    ckpt = state.ckpt.latest() if state is not None else None
    gone = model_dir is not None and not (Path(model_dir) / "config.json").is_file()
    print((f"grpo-launcher: the model dir {model_dir} is gone (no config.json): deleted or moved after the launch; "
           "restore it (model.path), then launch the same command again\n" if gone else "")
          + f"grpo-launcher: {who} {exc}\n  last completed step: {state.step if state else 0}; last checkpoint: "
          f"{ckpt or 'none'}; resume starts from it", file=sys.stderr, flush=True)
    workers.stuck = [exc.owner]
    if state is not None:
        if state.tracker is not None:
            state.tracker.set_tag("grpo.actor_died", f"{who} {exc}"[:500])
        state.abort()
    return ExitCode.FAILED


def source_class(spec: RunSpec, env: Any) -> type:
    """The loop's rollout source: the one the env's class names (env=nemo_gym: GymSource, Gym's servers around the
    loop, rollouts through its agents), else AsyncSource with grpo.async_grpo.enabled (generation overlaps the
    update; train/async_loop.py), else SyncSource."""
    named = getattr(type(env), "rollout_source", None)
    if named is not None:
        return named()
    if spec.grpo.async_grpo.enabled:
        return AsyncSource
    return SyncSource


def publish_rollout_endpoints(spec: RunSpec, plan: Plan, workers: Workers) -> None:
    """rollout.expose_http_server: every engine's OpenAI base URL → RUN_DIR/rollout_endpoints.json (and the log)."""
    if not spec.rollout.expose_http_server:
        return
    urls = workers.get("endpoints", [r.http_url.remote() for r in workers.rollout], workers.rollout)
    write_atomic(plan.run_dir / "rollout_endpoints.json",  # 0600: it holds the servers' API key
                 json.dumps({"model": spec.model.name, "base_urls": urls, "api_key": spec.rollout.http_api_key or None},
                            indent=1) + "\n", mode=0o600)
    print(f"grpo-launcher: rollout endpoints {' '.join(urls)}", flush=True)


class Trainer:
    """The GRPO loop: rollout → score → advantages → old logprobs → update → refit → log, one step at a time.

    One loop for every variant: what differs is the rollout source passed in (train/sources.py: sync, async, Gym),
    and the engines behind it are an EnginePool (train/engines.py: health, restarts, the refit strategy).
    Departures from the paper (DeepSeekMath's GRPO), each a setting:
      * one optimizer step per minibatch of train.global_batch_size, over the GLOBAL loss denominator
        (loss.aggregation: token_mean, seq_mean_token_mean, Dr. GRPO's seq_mean_token_sum_norm)
      * the old logprobs come from the update's own forward when the step is exactly on-policy
        (plan.logprobs_from_update), else from a logprob pass; the KL term only with loss.kl_coef > 0
      * DAPO's options: asymmetric clipping (loss.clip_high), dynamic sampling (refill groups whose rewards vary, at
        most loss.dynamic_sampling_max_rounds rounds), overlong filtering
      * the engines' logprobs may differ from the trainer's: loss.importance_sampling_correction weighs them
        (tis / icepop), and async GRPO trains on samples up to grpo.async_grpo.max_trajectory_age_steps old
      * a minibatch with nothing to learn (no loss-bearing sample; or, without a KL term, only groups whose
        rewards were all equal: a loss of 0) takes no optimizer step; the step line says why
    """

    clock: "StartupClock | None" = None  # set by run(): the start-up line after this process's first step

    def __init__(self, spec: RunSpec, plan: Plan, env: Any, workers: Workers, state: LoopState, stop: StopRequest,
                 model_dir: Path, source: type = SyncSource):
        self.spec, self.plan, self.env, self.w, self.state, self.stop = spec, plan, env, workers, state, stop
        self.tok = workers.get("load_tokenizer", [workers.policy[0].load_tokenizer.remote()],  # policy/hybrid.py:
                               workers.policy[:1])[0]  # why not AutoTokenizer
        write_prompting(plan.run_dir, self.tok, spec.env, state.data_log, model_dir,  # chat template, system prompt,
                        split_prompts(env, plan.prompts_per_step, validation_on(spec.grpo)))  # first prompts
        if hasattr(env, "data_origin"):  # a dataset's stream: a resume carries on where its checkpoint's steps left it
            env.data_origin = state.data_origin
        self.engines = EnginePool(spec, plan, workers, self.tok)
        self.source: RolloutSource = source(spec, plan, env, self.engines, stop)
        self.deadline = (time.monotonic() + parse_duration(spec.checkpoint.must_save_by)
                         if spec.checkpoint.must_save_by else None)

    def train(self) -> int:
        with self.source.session(self.state):
            return self.loop()

    def loop(self) -> int:
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
                self.clock.mark(f"step {step}")  # this start's first step: a resumed run's is not step 1
                print(self.clock.report(step), flush=True)
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
                saved = "checkpoint saved" if s.checkpoint.enabled else "no checkpoint (checkpoint.enabled=false)"
                print(f"grpo-launcher: stopped after step {step} ({self.stop.reason or 'must_save_by'}); {saved}",
                      flush=True)
                st.finish("KILLED")
                return ExitCode.REQUEUE if self.stop.requeue or self.deadline else self.stop.exit_code
        progress.close()
        st.finish("FINISHED")
        return 0

    def profiled_step(self, step: int) -> dict[str, float]:
        """logging.profile_step: this step's phases on every policy worker under torch.profiler."""
        where = self.plan.run_dir / "profile" / f"step_{step}"
        self.w.get("profile", [p.start_profile.remote(str(where)) for p in self.w.policy], self.w.policy)
        metrics = self.step(step)
        phases = self.w.get("profile", [p.stop_profile.remote() for p in self.w.policy], self.w.policy)
        print(f"grpo-launcher: profile of step {step} (rank 0; all ranks in {where}): {summary_line(phases[0])}",
              flush=True)
        return metrics

    def step(self, step: int) -> dict[str, float]:
        t = Timer()
        r = self.source.rollout(step, t)
        if self.plan.engine_sleeps:  # rollout.sleep_mode: the GPU memory is the policy's until the refit
            with t("sleep"):
                freed, held = self.engines.sleep()
        batch, m = self.source.make_batch(r.gens, r.rewards)
        keep_first_error(self.plan.run_dir, r.scored)
        m.update(reward_metrics("train", r.scored))
        if r.generated is not None:  # dynamic sampling: the rewards of all it generated, not the groups kept
            m.update(reward_summary(r.generated[0]), **reward_metrics("train", r.generated[1]))
        if not self.plan.logprobs_from_update:  # else the update's own forward gives them (on-policy)
            with t("logprobs"):
                batch = old_logprobs(self.w, self.spec.loss, self.plan.policy_ranks, batch)
        signal = algos.nonzero_variance_groups(r.rewards, self.plan.group_size)  # [P] groups with something to learn
        m[M.TRAIN_EQUAL_REWARD_GROUPS] = float((~signal).sum())
        with t("update"):
            batch, update_metrics = policy_update(self.w, self.spec, self.plan, batch,
                                                  algos.group_rows(signal, self.plan.group_size))
            m.update(update_metrics)
        with t("refit"):
            m[M.TIME_REFIT_MS] = self.source.refit(step)  # policy version `step`: the updates applied
        with t("log"):
            self.source.train_data(self.state, step, r, batch)
        gen_tokens = int(batch.response_mask.sum())
        m.update(t.as_metrics(), **{M.TRAIN_DYNAMIC_SAMPLING_ROUNDS: r.rounds,
                                    M.TRAIN_TOKENS_PER_S: gen_tokens / max(r.gen_s, 1e-9)})
        m.update(r.pipeline)
        if self.plan.engine_sleeps:
            m[M.ROLLOUT_SLEEP_FREED_GIB] = freed
            m[M.MEMORY_ENGINE_ASLEEP_GIB] = held
        m.update(self.engines.metrics())
        if M.TIME_GENERATION_IDLE_S not in m:  # sync: the engines idle through everything but the rollout
            m[M.TIME_GENERATION_IDLE_S] = max(m[M.TIME_STEP_S] - t.seconds["rollout"], 0.0)
        return m

    def refit(self) -> float:
        """The policy's current weights → the engines (before the first rollout; `launch.py eval` after a load)."""
        return self.source.refit(self.state.step)

    def generate(self, prompts: list, n: int, seed: int) -> list[Generation]:
        return self.source.generate(prompts, n, seed)

    def validate(self) -> dict[str, float]:
        g = self.spec.grpo
        prompts = self.env.val_prompts()
        prompts = prompts if g.max_val_samples is None else prompts[: g.max_val_samples]  # null = all
        if not prompts:  # a Gym run without val rows
            return {}
        rewards, scored = [], []
        self.w.clock.prefix = "val_"  # its waits have a history of their own (val_generate, val_score)
        try:
            for i in range(0, len(prompts), g.val_batch_size):  # a last partial batch is still validated
                chunk = prompts[i:i + g.val_batch_size]
                r, sc = self.source.score(chunk, self.source.generate(chunk, 1, seed=1234 + i), 1)
                rewards.append(r)
                scored += sc
        finally:
            self.w.clock.prefix = ""
        r = torch.cat(rewards)
        keep_first_error(self.plan.run_dir, scored)
        return {M.VAL_REWARD_MEAN: float(r.mean()), M.VAL_ACCURACY: float((r >= 1).float().mean()),
                M.VAL_SAMPLES: float(len(r)), **reward_metrics("val", scored)}

    def save(self, step: int, metrics: dict[str, float]) -> None:
        def write(tmp: Path) -> None:
            self.w.get("save", [p.save.remote(str(tmp)) for p in self.w.policy], self.w.policy)

        self.state.save_checkpoint(step, write, metrics)


def old_logprobs(w: Workers, lo: LossSpec, dp: int, batch: TrainBatch) -> TrainBatch:
    """The policy's (and the reference's) logprobs of the batch before the update, over the DP ranks; with
    loss.importance_sampling_correction the weights against the engines' logprobs."""
    parts = w.get("logprobs", [p.logprobs.remote(batch.select(shard_rows(len(batch), dp, i)))
                               for i, p in enumerate(w.policy)], w.policy)
    prev = torch.cat([a for a, _ in parts])
    ref = torch.cat([b for _, b in parts]) if parts[0][1] is not None else None
    isw = None
    if lo.importance_sampling_correction:
        isw = algos.is_correction_weights(prev, batch.generation_logprobs, batch.response_mask,
                                          mode=lo.is_truncation, threshold=lo.is_threshold, low=lo.is_threshold_low)
    return batch.with_(prev_logprobs=prev, ref_logprobs=ref, is_weights=isw)


def policy_update(w: Workers, spec: RunSpec, plan: Plan, batch: TrainBatch,
                  signal: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]:
    """One optimizer step per minibatch over the DP ranks; none for a minibatch with nothing to learn (no
    loss-bearing sample, or, without a KL or aux loss term, none whose group's rewards vary: `signal` [B]).
    Returns the batch (with the old logprobs the update itself computed, when the plan takes them from it) and the
    summed metrics."""
    gbs, dp = plan.minibatch_size, plan.policy_ranks
    spans = [slice(i, i + gbs) for i in range(0, len(batch), gbs)]
    minibatches = [batch.select(sl) for sl in spans]
    advantage_only = spec.loss.kl_coef == 0 and spec.train.moe.aux_loss_coeff == 0  # equal rewards: a loss of 0
    # global denominators; 0 = nothing to learn in the minibatch: every rank skips its step
    dens = [local_denominator(spec.loss.aggregation, algos.loss_mask(mb.response_mask, mb.sample_mask))
            if not advantage_only or algos.learns_anything(signal[sl], mb.response_mask, mb.sample_mask) else 0.0
            for sl, mb in zip(spans, minibatches)]
    results = w.get("update", [p.update.remote([mb.select(shard_rows(len(mb), dp, r)) for mb in minibatches], dens)
                               for r, p in enumerate(w.policy)], w.policy)
    if plan.logprobs_from_update:  # rank r returned the old logprobs of its shard
        ref = [res.pop("ref_logprobs") for res in results]
        batch = batch.with_(prev_logprobs=torch.cat([res.pop("prev_logprobs") for res in results]),
                            ref_logprobs=torch.cat(ref) if ref[0] is not None else None)
    memory = [res.pop("memory", {}) for res in results]  # GPUs: GiB per rank; the most loaded rank's
    first = ("grad_norm", "lr", "skipped_optimizer_steps")  # the same on every rank
    keys = {k for res in results for k in res if k not in first}
    out = {M.TRAIN_PREFIX + k: (max if algos.METRIC_REDUCTIONS.get(k) == "max" else sum)(res[k] for res in results if k in res)
           for k in keys}  # ranks' weighted means add up; maxima stay maxima
    out.update({M.TRAIN_GRAD_NORM: results[0]["grad_norm"], M.TRAIN_LR: results[0]["lr"],
                M.TRAIN_SKIPPED_OPTIMIZER_STEPS: results[0]["skipped_optimizer_steps"],
                M.TRAIN_OPTIMIZER_STEPS: float(len(minibatches) - results[0]["skipped_optimizer_steps"]),
                M.TRAIN_LOGPROBS_FROM_UPDATE: float(plan.logprobs_from_update)})
    out.update({k: max(m[k] for m in memory) for k in memory[0]})
    diff = (batch.prev_logprobs - batch.generation_logprobs).abs() * batch.response_mask
    out[M.TRAIN_GEN_VS_POLICY_LOGPROB_ABSDIFF] = float(diff.sum() / batch.response_mask.sum().clamp(min=1))
    return batch, out


def append_metrics(path: Path, step: int, metrics: dict[str, float]) -> None:
    """One JSON line per step (with or without MLflow): what benchmarks and scripts read. A resumed run first
    drops the lines after its checkpoint's step (train/setup.py trim_metrics): one line per step."""
    append_line(path, json.dumps({"step": step, **metrics}))  # whole or not at all: a full disk tears no line


def main() -> None:
    try:
        spec = load_spec_file(Path(sys.argv[1]))
    except ConfigError as err:  # spec.yaml edited since the launch: the key and the file named, no traceback
        print(err.render(), file=sys.stderr)
        sys.exit(ExitCode.CONFIG_ERROR)
    sys.exit(run(spec, make_plan(spec)))


if __name__ == "__main__":
    main()
