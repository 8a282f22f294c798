"""The GRPO loop with NeMo Gym as the environment: Gym's servers around the loop, rollouts through its agents.
(A rollout source of the loop, so it lives in train/; gym/ holds the parts it uses.)

train/driver.py runs the loop with GymSource for env=nemo_gym (GymEnv names it: `rollout_source`); its `session`
starts Gym's servers over the URLs the engines published (RUN_DIR/rollout_endpoints.json) and stops them when the
loop ends, however it ends. Everything else (logprobs, update, refit, validation cadence, checkpoints, logs) is the
driver's Trainer:

* `generate` sends G copies of each step row to the row's agent (`/run`, all at once) instead of calling the
  engines directly; the engines still serve every model call, over their HTTP servers, and are refit
  between steps as usual;
* `score` returns the rewards Gym's resources servers gave;
* `make_batch` sets the per-token loss mask (policy tokens only, across turns) and masks the samples that
  cannot be trained on (agent failures, non-contiguous multi-turn token streams, Gym's mask_sample).
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from ..batch import TrainBatch
from ..gym.rollouts import RolloutStats, run_rollouts, stamp_row
from ..gym.samples import GymGeneration
from ..gym.servers import GymServers
from ..plan import Plan
from ..spec.schema import RunSpec
from ..tracking import metric_names as M
from ..tracking.records import train_data_records
from .engines import EnginePool
from .loop_state import LoopState, StopRequest
from .sources import Rollout, Timer, make_batch, sync_rollout


def endpoints(run_dir: Path) -> tuple[str, list[str], str | None]:
    """(model name, engine base URLs, API key) from RUN_DIR/rollout_endpoints.json (driver.publish_rollout_endpoints)."""
    data = json.loads((Path(run_dir) / "rollout_endpoints.json").read_text())
    return data["model"], list(data["base_urls"]), data.get("api_key")


def start_servers(spec, plan, abort=None) -> GymServers:
    model, urls, key = endpoints(plan.run_dir)
    host = getattr(spec.env, "gym_host", None) or spec.rollout.http_host or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"  # Gym talks to the trainer on this node only
    print(f"grpo-launcher: starting NeMo Gym ({', '.join(spec.env.gym_config_paths)}) over {' '.join(urls)}",
          flush=True)
    servers = GymServers.start(list(spec.env.gym_config_paths), urls, model, plan.run_dir / "gym", api_key=key,
                               host=host, timeout_s=float(getattr(spec.env, "gym_start_timeout_s", 600.0)),
                               overrides=list(getattr(spec.env, "gym_overrides", []) or []), abort=abort)
    servers.watch(spec.deadlines.health_period_s, spec.deadlines.health_timeout_s)  # a frozen server: exit 4
    node = os.environ.get("SLURMD_NODENAME")  # in a Slurm job: the head node, where the driver's step runs
    print(f"grpo-launcher: NeMo Gym ready at {servers.head_url}{f' on Slurm node {node}' if node else ''} "
          f"(agents: {', '.join(sorted(servers.agents()))})", flush=True)
    return servers


class GymSource:
    """The loop's rollout source for env=nemo_gym (train/sources.py RolloutSource; the module doc says how)."""

    def __init__(self, spec: RunSpec, plan: Plan, env: Any, engines: EnginePool, stop: StopRequest) -> None:
        self.spec, self.plan, self.env, self.engines, self.stop = spec, plan, env, engines, stop
        self.w, self.tok = engines.w, engines.tok
        self.servers: GymServers | None = None
        self.agents: dict[str, str] = {}
        self.stats = RolloutStats()

    @contextmanager
    def session(self, state: LoopState) -> Iterator[None]:  # noqa: ARG002
        """Gym's servers for the duration of the loop: started over the published engine URLs, stopped by PID."""
        self.servers = start_servers(self.spec, self.plan, abort=lambda: self.stop.requested)
        try:
            self.agents = self.servers.agents()
            missing = sorted({p.agent_ref for p in [*self.env.train, *self.env.val]} - set(self.agents))
            if missing:
                raise RuntimeError(f"the rows name agents Gym does not run: {', '.join(missing)} (running: "
                                   f"{', '.join(sorted(self.agents))}); add their configs to env.gym_config_paths")
            yield
        finally:
            self.servers.stop()
            s = self.stats
            print(f"grpo-launcher: NeMo Gym stopped; {s.rollouts} rollouts, {s.failed} failed, "
                  f"{s.non_contiguous} non-contiguous (masked)", flush=True)

    def rollout(self, step: int, t: Timer) -> Rollout:
        return sync_rollout(self, step, t)  # Gym's rollouts are generated now, as sync ones (dynamic sampling too)

    def refit(self, version: int) -> float:  # noqa: ARG002
        return self.engines.refit()  # the engines serve Gym's model calls: refit between steps as usual

    # ------------------------------------------------------------------ rollouts through Gym
    def generate(self, prompts: list, n: int, seed: int) -> list[GymGeneration]:  # noqa: ARG002 (Gym has no seed)
        r = self.spec.rollout
        rows = [stamp_row(p.row, r.temperature, getattr(r, "top_p", 1.0), r.max_new_tokens) for p in prompts for _ in range(n)]
        assert self.servers is not None, "generate runs inside session()"
        before = self.stats.failed
        with self.w.clock.timed("generate") as limit:  # each agent call within the phase's deadline (deadlines.py)
            gens = run_rollouts(rows, self.agents, check=self.servers.check, max_model_len=self.plan.max_model_len,
                                stats=self.stats, log_path=self.plan.run_dir / "gym" / "rejected_rows.jsonl",
                                timeout_s=limit or 900.0)
        if self.stats.failed > before:
            first = next(g.failed for g in gens if g.failed)
            print(f"grpo-launcher: {self.stats.failed - before} of {len(gens)} Gym rollouts failed (masked, kept in "
                  f"their groups); first: {first}", file=sys.stderr, flush=True)
        return gens

    def score(self, prompts: list, gens: list, n: int) -> tuple[torch.Tensor, list[None]]:  # noqa: ARG002
        return torch.tensor([g.reward for g in gens], dtype=torch.float32), [None] * len(gens)

    def make_batch(self, gens: list, rewards: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]:
        """A failed rollout (its reward a placeholder) or one the environment masked is left out of its group's
        baseline as well as the loss: [1, 1, 1, failed] gives its three valid samples 0, not +0.5 each."""
        valid = torch.tensor([not (g.failed or g.mask_sample) for g in gens])
        batch, m = make_batch(self.spec, self.plan.group_size, self.tok, gens, rewards, valid=valid)
        mask = torch.zeros_like(batch.response_mask)
        keep = torch.ones(len(gens))
        for i, g in enumerate(gens):
            lm = torch.tensor(g.loss_mask, dtype=mask.dtype)
            mask[i, : len(lm)] = lm
            keep[i] = float(g.trainable)
        batch = batch.with_(response_mask=mask, sample_mask=batch.sample_mask * keep)
        lens = mask.sum(-1)
        m.update({M.TRAIN_GEN_LEN_MEAN: float(lens.mean()),
                  M.GYM_FAILED_ROLLOUTS: float(sum(bool(g.failed) for g in gens)),
                  M.GYM_NON_CONTIGUOUS_SAMPLES: float(sum(not g.contiguous for g in gens)),
                  M.GYM_ENV_MASKED_SAMPLES: float(sum(g.mask_sample for g in gens)),
                  M.GYM_TURNS_MEAN: sum(g.turns for g in gens) / max(len(gens), 1),
                  M.GYM_MULTI_TURN_SAMPLES: float(sum(g.turns > 1 for g in gens)),
                  M.GYM_TRAINABLE_SAMPLES: float(keep.sum())})
        return batch, m

    def train_data(self, state: LoopState, step: int, r: Rollout, batch: TrainBatch) -> None:
        """The log's token_loss_mask is the Gym mask, not "every response token"."""
        if state.data_log is None or not state.data_log.enabled_for(step):
            return
        def records() -> Iterator[dict]:
            for i, rec in enumerate(train_data_records(step, r.prompts, r.gens, r.rewards, batch, self.spec, self.tok,
                                                       self.plan.group_size)):
                p, n = len(r.gens[i].prompt_ids), len(r.gens[i].response_ids)
                rec["token_loss_mask"] = [0] * p + [int(x) for x in batch.response_mask[i, :n].tolist()]
                yield rec

        state.data_log.write_step(step, records(), r.versions)
