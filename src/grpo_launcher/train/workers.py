"""Ray bring-up for one run: a placement group from the Plan, then policy, rollout and env actors in it.

Bundle i stands for device i (a GPU, or a CPU worker slot). Colocated (cluster.rollout_devices=0): policy
rank i and rollout engine i share bundle i; an engine with TP > 1 is anchored on the first bundle of its TP
group. Non-colocated (async GRPO): the policy ranks hold bundles [0, T), the engines the bundles after them.
"""

from __future__ import annotations

import math
import os
import resource
import subprocess
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import psutil
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..envs import EnvFactory, make_env
from ..envs.rewards import Scored
from ..preflight.slurm import RAY_TEMP_DIR_MAX
from ..plan import Plan
from ..policy import policy_class
from ..rollout import rollout_class
from ..spec.schema import RunSpec
from ..deadlines import HEALTH_GROUP, ActorInfo, EngineProbe, PhaseClock, actor_info
from .engines import ENGINE_KINDS

WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
              "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "RAY_DEDUP_LOGS": "1",
              "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOGGING_COLOR": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@contextmanager
def ray_session(spec: RunSpec, plan: Plan, keep_sigterm: bool = False) -> Iterator[None]:
    """Join the job's Ray cluster (RAY_ADDRESS, set by the sbatch script) or start one here. keep_sigterm (the
    driver, whose StopRequest handles SIGTERM): ray.init does not swap in Ray's own handler while it runs."""
    with ray_keeps_our_sigterm() if keep_sigterm else nullcontext():
        _ray_init(spec, plan)
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def ray_keeps_our_sigterm() -> Iterator[None]:
    """ray.init sets a SIGTERM handler of its own for its length (sys.exit(15), raised wherever the main thread is):
    a SIGTERM then ended the run with exit 15 and no message, or, raised in a finalizer that held logging's lock,
    was swallowed ('Exception ignored') and left the lock held: the next thread that logged waited for ever, and
    the driver with it. The driver's handler (a stop: the step, a checkpoint, exit 143) stays in place instead."""
    utils = ray._private.utils  # private: what ray.init calls, looked up at call time
    saved = getattr(utils, "set_sigterm_handler", None)
    if saved is None:  # another Ray: nothing to keep
        yield
        return
    utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = saved


def _ray_init(spec: RunSpec, plan: Plan) -> None:
    env = dict(WORKER_ENV, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), _src()) if p),
               TRITON_CACHE_AUTOTUNING=os.environ.get("TRITON_CACHE_AUTOTUNING", "1"),  # see quiet_libraries
               **collective_timeout_env(spec))
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env}, logging_level="WARNING")
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        slots = plan.nodes * plan.devices_per_node
        before = _descendants()
        ray.init(num_cpus=max(1, math.ceil(slots * plan.bundle.get("CPU", 1.0))), include_dashboard=False,
                 object_store_memory=spec.cluster.object_store_memory_mb * 2**20,
                 runtime_env={"env_vars": env}, logging_level="WARNING",
                 # lean: no idle workers started ahead (every actor here has its own runtime env), no metrics
                 _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                                 "enable_metrics_collection": False})
        start_reaper(sorted(set(_descendants()) - set(before)))


_REAPERS: list[subprocess.Popen] = []  # held: a reaper dropped while running warns (ResourceWarning)


def _descendants() -> list[tuple[int, float]]:
    """(pid, create time) of every live descendant of this process."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            out.append((p.pid, p.create_time()))
        except psutil.Error:
            continue
    return out


def start_reaper(started: list[tuple[int, float]]) -> None:
    """The processes ray.init started here, SIGKILLed once this process is gone if they outlive it by
    reaper.GRACE_S: killed with SIGKILL (the OOM killer), it left Ray's dashboard and runtime-env agents hanging for
    ever (train/reaper.py). An earlier session's reaper that has exited is collected here."""
    _REAPERS[:] = [r for r in _REAPERS if r.poll() is None]
    _REAPERS.append(subprocess.Popen(
        [sys.executable, "-m", "grpo_launcher.train.reaper", str(os.getpid()), *(f"{pid}:{ct!r}" for pid, ct in started)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
        start_new_session=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (_src(), os.environ.get("PYTHONPATH")) if p))))


def ray_temp_problem(spec: RunSpec) -> str | None:
    """Why a Ray started here could not write its temp dir (RAY_TMPDIR, else TMPDIR, else /tmp: Ray's own order) or
    its object store (a file-size limit below cluster.object_store_memory_mb), or None; a joined cluster
    (RAY_ADDRESS) keeps its own. ray.init died with a 35-line OSError traceback, or timed out after ~40 s."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    fsize = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if fsize != resource.RLIM_INFINITY and fsize < spec.cluster.object_store_memory_mb * 2**20:
        return (f"the file-size limit (ulimit -f: {fsize / 2**20:.1f} MiB) is below Ray's object store "
                f"(cluster.object_store_memory_mb={spec.cluster.object_store_memory_mb}): Ray's raylet would die "
                "of SIGXFSZ; raise the limit (ulimit -f unlimited) or lower cluster.object_store_memory_mb")
    var = next((v for v in ("RAY_TMPDIR", "TMPDIR") if os.environ.get(v)), None)
    where = Path(os.environ[var] if var else "/tmp") / "ray"
    if len(str(where)) > RAY_TEMP_DIR_MAX:  # as the Slurm rule on cluster.ray_temp_dir
        return (f"Ray's temp dir {where} (from {var}) is {len(str(where))} characters: Ray's socket paths under it "
                "would pass the 107 bytes AF_UNIX allows; set RAY_TMPDIR to a short path (e.g. /tmp), then launch the "
                "same command again")
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".grpo-probe-") as f:  # a full disk fails here
            f.write(b"\0" * 4096)
            f.flush()
    except OSError as exc:
        return (f"Ray cannot write its temp dir {where} (from {var or 'the default: RAY_TMPDIR and TMPDIR unset'}): "
                f"{exc.strerror or exc}; set RAY_TMPDIR to a writable directory with free space and a short path "
                "(Ray's AF_UNIX sockets live there: at most 107 bytes), then launch the same command again")
    return None


def collective_timeout_env(spec: RunSpec) -> dict[str, str]:
    """The policy ranks' gloo/NCCL timeout (torch.distributed's init_process_group): deadlines.first_s, the longest
    any driver wait lasts before it is called hung (policy/torch_policy.py reads it)."""
    d = spec.deadlines
    return {COLLECTIVE_TIMEOUT_ENV: f"{d.first_s:g}"} if d.enabled else {}


COLLECTIVE_TIMEOUT_ENV = "GRPO_COLLECTIVE_TIMEOUT_S"


def _src() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Workers:
    policy: list[Any]  # one actor per DP rank (x model-parallel ranks for megatron)
    rollout: list[Any]  # one actor per engine (rollout=hf: the policy actors themselves)
    env: Any
    pg: Any
    clock: PhaseClock  # every wait for these actors has a deadline (deadlines.py)
    stuck: list[Any] = field(default_factory=list)  # the actors a passed deadline named: killed, not asked to stop
    new_engine: Callable[[int], Any] | None = None  # engine e started again on its bundle (separate engines)
    probe: EngineProbe | None = None  # rollout=vllm: the engines' health probe (deadlines.health_period_s)

    def get(self, phase: str, refs: list, owners: Sequence[Any]) -> list:
        """ray.get(refs) within the phase's deadline (Hung past it); owners[i] is the actor computing refs[i]."""
        return self.clock.get(phase, refs, owners)

    def ready(self) -> None:
        """Wait for the actors (they import and load meanwhile) and join the policy ranks' process group."""
        host, port = self.get("start", [self.policy[0].address.remote()], self.policy[:1])[0]
        self.get("init_distributed", [p.init_distributed.remote(host, port) for p in self.policy], self.policy)

    def role_of(self, actor: Any) -> tuple[str, int]:
        """(role, rank) of one of these actors: policy i (with rollout=hf also engine i), rollout e, or env 0."""
        for role, group in (("policy", self.policy), ("rollout", self.rollout), ("env", [self.env])):
            for i, a in enumerate(group):
                if a is actor or a == actor:
                    return role, i
        return "actor", -1

    def describe(self, actors: Sequence[Any]) -> list[ActorInfo]:
        return [actor_info(a, *self.role_of(a)) for a in actors]

    def restart_engine(self, e: int) -> Any:
        """Rollout engine e killed (whatever is left of it) and started again on its bundle; the new handle."""
        assert self.new_engine is not None
        ray.kill(self.rollout[e], no_restart=True)
        self.rollout[e] = self.new_engine(e)
        return self.rollout[e]

    def shutdown(self, timeout: float = 30.0) -> None:
        self.clock.close()
        if self.probe is not None:
            self.probe.close()  # first: no engine is killed while they stop
        separate = [r for r in self.rollout if r not in self.policy and r not in self.stuck]  # hybrid: the policy
        # workers are the engines
        for ref in [r.shutdown.remote() for r in separate]:  # all at once, then each one's outcome
            try:
                ray.get(ref, timeout=timeout)  # a hung engine is killed below all the same
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # it died or hangs: killed below
                pass
        for a in [*self.policy, *separate, self.env]:
            ray.kill(a)
        remove_placement_group(self.pg)


def create_workers(spec: RunSpec, plan: Plan, model_dir: str) -> Workers:
    """Policy rank i on bundle i; with rollout=hf it is also engine i (hybrid), else engine e shares bundle e·TP;
    with devices of their own (plan.rollout_devices) engine e is on bundle train_devices + e·TP.

    Returns at once: the actors start (imports, model load) while the driver sets up; `ready()` waits. Separate
    engines are created first, the longest to start (vLLM's import, profile run, CUDA graphs; an HF engine's load):
    their processes start before the policy's (Ray starts a node's worker processes at most num_cpus at a time:
    one at a time in a local 1-GPU run) and their start overlaps the policy's load. Safe on a GPU the policy shares: no engine sizes
    anything from the memory it finds free (vLLM is given its KV cache, rollout/vllm.py kv_cache_bytes; its start
    only checks that rollout.gpu_memory_utilization × the GPU is free, which pre-flight's peak, the policy's
    start-up memory included, guarantees in either order). The placement group is waited for last (actors queue
    for it meanwhile): its creation overlaps the classes' imports."""
    pg = placement_group([dict(plan.bundle) for _ in range(plan.world_size)], strategy="PACK")
    on = BundleOptions(plan, pg)
    rollout, new_engine, probe = ([], None, None) if plan.hybrid_rollout else start_engines(spec, plan, model_dir, on)
    P = ray.remote(policy_class(spec.train.backend))
    policy = [P.options(**on(i)).remote(spec, model_dir, i, plan.policy_ranks, on.threads)
              for i in range(plan.policy_ranks)]
    env = ray.remote(EnvWorker).options(num_cpus=0).remote(spec, EnvFactory(spec))  # the driver's env class
    ray.get(pg.ready(), timeout=spec.cluster.ray_join_timeout_s)  # never placed: GetTimeoutError, as before
    return Workers(policy=policy, rollout=policy if plan.hybrid_rollout else rollout, env=env, pg=pg,
                   clock=PhaseClock(spec.deadlines, plan.run_dir), new_engine=new_engine, probe=probe)


class BundleOptions:
    """An actor's Ray options on bundle i of the run's placement group. A device slot is the policy's alone
    (hybrid engine, or engines elsewhere), or half of it with an engine beside it (its cores too: `threads`)."""

    def __init__(self, plan: Plan, pg: Any) -> None:
        self.plan, self.pg = plan, pg
        self.share = 1.0 if plan.hybrid_rollout or plan.rollout_devices else 0.5
        self.threads = max(1, int(plan.bundle.get("CPU", 1.0) * self.share))

    def __call__(self, i: int) -> dict:
        gpu = {"num_gpus": self.share} if self.plan.use_gpus else {}
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                "num_cpus": self.plan.bundle.get("CPU", 1.0) * self.share, **gpu}


def start_engines(spec: RunSpec, plan: Plan, model_dir: str,
                  on: BundleOptions) -> tuple[list, Callable[[int], Any], EngineProbe | None]:
    """The separate rollout engines, created (their processes start at once); how to start engine e again; their
    health probe (rollout=vllm with deadlines.health_period_s > 0)."""
    cls = rollout_class(spec.rollout.backend)
    from ..rollout.versions import WEIGHTS_GROUP  # here: it imports torch, which the env worker (this module) must not

    # async GRPO with in-flight weight updates: stage_weights runs beside a generate call (rollout/versions.py)
    staged = plan.async_grpo and spec.grpo.async_grpo.in_flight_weight_updates
    probed = ENGINE_KINDS[spec.rollout.backend].health_probe and spec.deadlines.health_period_s > 0
    groups = {**({WEIGHTS_GROUP: 1} if staged else {}), **({HEALTH_GROUP: 1} if probed else {})}
    R = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)
    tp = spec.rollout.tensor_parallel_size

    def new_engine(e: int) -> Any:
        return R.options(**on(plan.engine_bundle0 + e * tp)).remote(spec, model_dir, on.threads,
                                                                   max_model_len=plan.max_model_len)

    d = spec.deadlines
    probe = EngineProbe(d.health_period_s, d.health_timeout_s) if probed else None
    return [new_engine(e) for e in range(plan.rollout_engines)], new_engine, probe


def own_score(cls: type) -> bool:
    """Whether cls's score is defined below the class that defines its score_detail (an override)."""
    mro = cls.__mro__
    where = lambda name: next(i for i, c in enumerate(mro) if name in vars(c))  # noqa: E731
    return where("score") < where("score_detail")


class EnvWorker:
    """Scores completions for the env named in the spec (runs as its own Ray actor)."""

    def __init__(self, spec: RunSpec, factory=None):
        self.env = factory() if factory is not None else make_env(spec)  # factory: the class the driver loaded

    def score(self, prompts: list, completions: list[str]) -> list[Scored]:
        """Scored per completion (envs/rewards.py): an env with per-function rewards gives its score_detail,
        unless a subclass overrides score below it (a user's MathEnv subclass: its score is the reward)."""
        detail = getattr(self.env, "score_detail", None)
        if detail is not None and own_score(type(self.env)):
            detail = None
        return [detail(p, c) if detail else Scored(self.env.score(p, c)) for p, c in zip(prompts, completions)]
