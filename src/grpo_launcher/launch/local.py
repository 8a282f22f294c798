"""cluster=local: run the GRPO driver in this process, against a Ray instance it starts here (run_local); or, for
`launch.py eval|generate`, the run's workers without the loop (run_workers).

The run dir is locked for this process (a second launch of the run is refused, naming it); Ray's auth
token is a fresh 0600 file in the run dir."""

from __future__ import annotations

import os
import secrets
import signal
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from ..exit_codes import ExitCode
from ..plan import Plan
from ..secrets import write_private
from ..spec.errors import ConfigError, Violation
from ..spec.schema import RunSpec
from . import rundir
from .local_status import recorded

if TYPE_CHECKING:  # launch/__init__.py says why
    from ..train.driver import Trainer
    from .preflight import Launch

T = TypeVar("T")


def run_local(launch: Launch) -> int:
    spec, plan = launch.spec, launch.plan
    if spec.dry_run:
        print("dry run: nothing started")
        return ExitCode.OK
    # From the plan on, a Ctrl-C (or SIGTERM) is recorded until the driver's own handler takes it over: raised as
    # KeyboardInterrupt inside an import that swallows it, it was lost now and then, and the run trained to its end.
    with signals_held() as held:
        try:  # one live process per run dir (a Slurm job of the same run counts too)
            rundir.acquire_run_lock(plan.run_dir, "local")
        except OSError as exc:
            return rundir.unmakeable(plan.run_dir, exc)
        except rundir.RunBusy as holder:
            print(f"error: run '{spec.name}' is already in use by {holder} (run dir {plan.run_dir}); "
                  f"wait for it, cancel it, or pick another name=", file=sys.stderr)
            return ExitCode.FAILED
        try:
            rundir.prepare(spec, plan)
            with ray_environment(spec, plan):
                from ..train.driver import run  # torch and Ray: imported by a run, never by pre-flight

                with recorded(spec, plan) as rec:  # status.json + logs/driver-local.log: `launch.py status|logs`
                    if held:  # a stop before the driver started: nothing has started, nothing to save
                        rec["rc"], rec["message"] = stopped_while_starting(held[0])
                        return rec["rc"]
                    try:
                        rec["rc"] = run(spec, plan, pending=held)  # one that comes in between: the driver's
                    except ConnectionError as exc:  # ray.init's, joining cluster=ray (an auth failure: the same)
                        if not spec.cluster.ray_address:
                            raise
                        rec["rc"] = refuse_connection(spec.cluster.ray_address, exc)
                return rec["rc"]
        finally:
            rundir.release_run_lock(plan.run_dir)


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def signals_held() -> Iterator[list[int]]:
    """SIGINT / SIGTERM while a run starts (its run dir, the driver's modules: torch, Ray, seconds) are recorded, for
    the caller to act on (the driver's own handler takes over in its first line, given what came in between).
    Python's KeyboardInterrupt there was lost now and then (raised inside an import that swallows it): the user's
    Ctrl-C, and the run trained on."""
    held: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in HELD_SIGNALS}
    for sig in HELD_SIGNALS:
        signal.signal(sig, lambda signum, _frame: held.append(signum))
    try:
        yield held
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def stopped_while_starting(signum: int) -> tuple[int, str]:
    """(exit code, status message) of a run stopped by a signal before its driver started: 130 / 143."""
    name = signal.Signals(signum).name
    message = f"stopped while starting ({name}): nothing was trained; the same command starts it again"
    print(f"grpo-launcher: {message}", file=sys.stderr, flush=True)
    return 128 + signum, message


def run_workers(launch: Launch, work: Callable[[Trainer], T]) -> T:
    """`launch.py eval|generate`: the run's Ray workers (policy, engines, env) brought up on this machine, without
    the loop, and work(trainer) called; the workers are stopped whatever happens. The plan's run dir is where the
    command writes (phase.json, prompting.json), never the run's own."""
    from ..envs import make_env  # torch and Ray: imported by a run, never by pre-flight
    from ..train.driver import Trainer
    from ..train.loop_state import LoopState, StopRequest
    from ..train.setup import prepare_model
    from ..train.startup import quiet_libraries
    from ..train.workers import create_workers, ray_session

    spec, plan = launch.spec, launch.plan
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    quiet_libraries()
    env = make_env(spec)
    model_dir = prepare_model(spec, plan, env)
    with ray_environment(spec, plan), ray_session(spec, plan):  # its own Ray token, as a local run
        workers = create_workers(spec, plan, str(model_dir))
        try:
            workers.ready()
            state = LoopState(spec, plan, ckpt=None, tracker=None)
            return work(Trainer(spec, plan, env, workers, state, StopRequest(), model_dir))  # Ctrl-C: Python's
        finally:
            workers.shutdown()


# Set for a run's own Ray (join_existing_cluster, private_ray_token, the metrics listener; ray.init sets
# RAY_AUTH_MODE itself): none of them outlives the run, or an in-process sweep's next point would join with the last
# point's token.
RUN_ENV = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_enable_metrics_collection")


@contextmanager
def ray_environment(spec: RunSpec, plan: Plan) -> Iterator[None]:
    """The Ray variables of one run in this process (a local run, eval/generate), put back when it ends."""
    saved = {k: os.environ.get(k) for k in RUN_ENV}
    try:
        if spec.cluster.ray_address:
            join_existing_cluster(spec.cluster.ray_address)
        else:
            private_ray_token(plan)
        # no Ray Prometheus listener: it binds every interface without auth (the run's metrics go to MLflow)
        os.environ.setdefault("RAY_enable_metrics_collection", "0")
        yield
    finally:
        for key, value in saved.items():  # the next run of an in-process sweep starts from the user's
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        ray_rereads_auth()


def ray_rereads_auth() -> None:
    """Ray reads RAY_AUTH_MODE when it is imported and caches its token at first use; where this process imported
    it already, both are read again from the environment now (what ray.init does when it turns token auth on)."""
    if "ray" not in sys.modules:  # only where Ray is loaded already (so imported here); Cython: no type stubs below
        return
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def join_existing_cluster(address: str) -> None:
    """cluster=ray: the driver joins RAY_ADDRESS (train/workers.py ray_session) and never starts or stops it. A
    cluster with token auth (Ray's default) refuses a driver that does not send its token: RAY_AUTH_MODE=token when
    a token is at hand and no mode was chosen."""
    os.environ["RAY_ADDRESS"] = address
    token = os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(
        os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token"))
    if token and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
    ray_rereads_auth()
    print(f"grpo-launcher: joining the Ray cluster at {address} (auth: {os.environ.get('RAY_AUTH_MODE', 'none')}); "
          "it is not started or stopped by this run", flush=True)


def refuse_connection(address: str, exc: BaseException) -> int:
    print(ConfigError([Violation(
        "ray_cluster_auth", ("cluster.ray_address",), f"could not join the Ray cluster at {address}: {exc}",
        "check the address, and the cluster's auth: RAY_AUTH_MODE=token with its token in RAY_AUTH_TOKEN, "
        "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (`ray get-auth-token` on the head)")]).render(),
        file=sys.stderr, flush=True)
    return ExitCode.CONFIG_ERROR


def private_ray_token(plan: Plan) -> None:
    """The local Ray cluster's auth token: a fresh one per run in RUN_DIR/.ray_auth_token (0600), not Ray's
    default ~/.ray/auth_token (written 0644 by Ray). An explicitly configured token/mode is left alone."""
    if any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")):
        return
    path = plan.run_dir / ".ray_auth_token"
    write_private(path, secrets.token_hex(32))
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path))
    ray_rereads_auth()
