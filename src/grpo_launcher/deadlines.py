"""No silent hangs: every driver wait for another process has a deadline (deadlines.* in the spec).

A phase (generate, score, logprobs, update, refit, save, ...) may wait max(factor × its slowest of the last
`window` waits, floor_s); its first wait in this process (no history: load, warm-up, compilation) first_s.
`PhaseClock.get` is `ray.get` with that timeout: on time it records how long the wait took; past it, it raises
`Hung` naming the phase and the calls still pending. It also notes each wait's start (the phase, the step, since
when, its deadline) for RUN_DIR/phase.json, which `launch.py status` shows: a file of its own, so that the driver
never races the launcher's or the job script's writes of status.json. A daemon thread writes it at most once per
`PhaseClock.period` s when it changed: a wait costs a dict, not a file write (a wait shorter than the period may
never be written; a slow one is, within a second).

The driver (train/driver.run) turns a `Hung` into the report (`hang_report`): the phase, the actors (role,
rank, node, pid), the last step and checkpoint, each stuck actor's stack (py-spy, when installed, run on the
actor's own node by a Ray task pinned there), then exit 4.

Ray is imported inside the functions that use it: launch/status.py (the job script's status writes, `launch.py
status`) reads phase.json through `read_phase` here and imports no Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .spec.schema import DeadlinesSpec

PHASE_FILE = "phase.json"


def deadline_s(recent: Sequence[float], cfg: DeadlinesSpec) -> float:
    """max(k × the slowest recent wait, the floor); first_s when there is no history yet."""
    if not recent:
        return max(cfg.first_s, cfg.floor_s)
    return max(cfg.factor * max(recent), cfg.floor_s)


def explain(recent: Sequence[float], cfg: DeadlinesSpec) -> str:
    """How a deadline was reached, in the keys' terms (for the hang message)."""
    if not recent:
        floor = f", raised to deadlines.floor_s={cfg.floor_s:g}" if cfg.floor_s > cfg.first_s else ""
        return f"the phase's first wait: deadlines.first_s={cfg.first_s:g}{floor}"
    return (f"max(deadlines.factor={cfg.factor:g} × {max(recent):.2f} s, the slowest of its last {len(recent)} "
            f"waits; deadlines.floor_s={cfg.floor_s:g})")


class Hung(Exception):
    """A wait passed its deadline: `owners` are the actors (of the wait's calls) that had not answered."""

    def __init__(self, phase: str, step: int, waited: float, how: str, owners: list[Any]) -> None:
        super().__init__(f"phase {phase} of step {step}: no answer after {waited:.1f} s ({how})")
        self.phase, self.step, self.waited, self.how, self.owners = phase, step, waited, how, owners


class ActorDied(Exception):
    """An actor of a wait died (kill -9, OOM, a crash): the run fails at once naming it (not a hang)."""

    def __init__(self, phase: str, step: int, owner: Any, reason: str) -> None:
        super().__init__(f"died in phase {phase} of step {step}: {reason}")
        self.phase, self.step, self.owner = phase, step, owner


class EngineLost(Hung):
    """A rollout engine was lost (died, or killed by the health probe) once more than deadlines.engine_restarts
    allows: the run ends as a hang does (exit 4), naming the engine."""

    def __init__(self, phase: str, step: int, owner: Any, reason: str, cap: int) -> None:
        Exception.__init__(self, f"phase {phase} of step {step}: rollout engine lost ({reason}); "
                                 f"deadlines.engine_restarts={cap} restarts already made")
        self.phase, self.step, self.waited, self.how, self.owners = phase, step, 0.0, "", [owner]


def died(exc: Exception, phase: str, step: int, owners: Sequence[Any], oom_base: int | None = None) -> ActorDied:
    """The ActorDied of Ray's ActorDiedError (its actor_id names the owner; else the first owner)."""
    aid = getattr(exc, "actor_id", None)
    owner = next((o for o in owners if getattr(getattr(o, "_actor_id", None), "hex", lambda: None)() == aid),
                 owners[0] if owners else None)
    return ActorDied(phase, step, owner, death_reason(exc, oom_base))


def oom_kills() -> int | None:
    """The kernel's count of OOM kills on this node since boot (/proc/vmstat oom_kill: a memory cgroup's limit
    too), or None where it cannot be read. No dmesg needed (often not readable in a container)."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def death_reason(exc: BaseException, oom_base: int | None) -> str:
    """Why Ray says an actor died, in a line. Ray cannot tell the kernel's OOM killer from kill -9 ("Worker
    unexpectedly exits with a connection error code 2"): the node's OOM-kill count since the run began (`oom_base`)
    can, on the driver's node; Ray's own memory monitor says so in its text (OutOfMemoryError)."""
    text = str(exc)
    if type(exc).__name__ == "OutOfMemoryError" or "running low on memory" in text:
        return "out of memory: Ray's memory monitor killed its process (the node ran low on memory)"
    if "connection error code 2" not in text and "killed by the OOM killer" not in text:
        return (text.strip().splitlines() or [type(exc).__name__])[0]
    now = oom_kills()
    if now is not None and oom_base is not None and now > oom_base:
        return (f"out of memory: its process was killed (SIGKILL), and the kernel's OOM killer killed {now - oom_base} "
                "process(es) on this node during the run (/proc/vmstat oom_kill)")
    known = "; no OOM kill on the driver's node during the run (/proc/vmstat oom_kill)" if now is not None else ""
    return ("its process was killed (SIGKILL) or crashed: most often out of memory (the kernel's OOM killer), else "
            f"kill -9 or a crash{known}")


class PhaseClock:
    """The deadlines of one driver process: per-phase history, `get` with a timeout, RUN_DIR/phase.json."""

    def __init__(self, cfg: DeadlinesSpec, run_dir: Path | None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.step = 0  # the step in progress (the driver sets it)
        self.prefix = ""  # "val_" while validating: its waits have their own history
        self.history: dict[str, deque[float]] = {}
        self.current: dict = {}  # the wait in progress (phase.json's content)
        self.written: dict | None = None
        self.period = 1.0
        self.oom_base = oom_kills()  # the node's OOM kills before this run: a worker's SIGKILL after, named as OOM
        self.closed = threading.Event()
        if run_dir is not None:
            threading.Thread(target=self._writer, name="grpo-phase-file", daemon=True).start()

    def _writer(self) -> None:
        while not self.closed.wait(self.period):
            self.flush()

    def close(self) -> None:
        """Stop the phase.json writer (the workers are gone): a later run in this process starts its own."""
        self.closed.set()

    def flush(self) -> None:
        """Write phase.json now if the phase changed since the last write."""
        rec = self.current
        if rec is not self.written:
            self.write(rec)
            self.written = rec

    def limit(self, phase: str) -> float | None:
        if not self.cfg.enabled:
            return None
        return deadline_s(self.history.get(phase, ()), self.cfg)

    def get(self, phase: str, refs: list, owners: Sequence[Any]) -> list:
        """ray.get(refs) within the phase's deadline; `owners[i]` is the actor computing refs[i]."""
        import ray  # here: see the module docstring

        phase = self.prefix + phase
        limit = self.limit(phase)
        t0 = time.monotonic()
        self.mark(phase, limit)
        try:
            out = ray.get(refs, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise self.hung(phase, refs, owners, time.monotonic() - t0) from None
        except (ray.exceptions.ActorDiedError, ray.exceptions.OutOfMemoryError) as exc:
            raise died(exc, phase, self.step, owners, self.oom_base) from exc
        self.record(phase, time.monotonic() - t0)
        return out

    @contextmanager
    def timed(self, phase: str) -> Iterator[float | None]:
        """A wait the caller bounds itself (Gym's HTTP calls: their per-request timeout): yields the deadline."""
        phase = self.prefix + phase
        limit = self.limit(phase)
        t0 = time.monotonic()
        self.mark(phase, limit)
        yield limit
        self.record(phase, time.monotonic() - t0)

    def wait_all(self, phase: str, refs: list, owners: Sequence[Any]) -> None:
        """ray.wait for every ref (its value not fetched) within the phase's deadline."""
        import ray  # here: see the module docstring

        limit = self.limit(phase)
        t0 = time.monotonic()
        self.mark(phase, limit)
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=limit)
        if pending:
            raise self.hung(phase, refs, owners, time.monotonic() - t0)
        self.record(phase, time.monotonic() - t0)

    def hung(self, phase: str, refs: list, owners: Sequence[Any], waited: float) -> Hung:
        import ray  # here: see the module docstring

        _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        stuck = [owners[i] for i, r in enumerate(refs) if r in pending]
        return Hung(phase, self.step, waited, explain(self.history.get(phase, ()), self.cfg), stuck)

    def record(self, phase: str, seconds: float) -> None:
        self.history.setdefault(phase, deque(maxlen=max(1, self.cfg.window))).append(seconds)

    def mark(self, phase: str, limit: float | None) -> None:
        """What the driver waits for now (phase.json's next content; one dict, no I/O here)."""
        self.current = {"phase": phase, "step": self.step, "since": round(time.time(), 3), "pid": os.getpid(),
                        "deadline_s": None if limit is None else round(limit, 1)}

    def mark_hung(self, summary: str) -> None:
        """phase.json keeps the stuck phase and says why the run ended (status.json's HUNG message), written now."""
        self.current = {**self.current, "hung": summary}
        self.flush()

    def write(self, rec: dict) -> None:
        """Atomically: temp file + rename."""
        if self.run_dir is None or not rec:
            return
        tmp = self.run_dir / f".{PHASE_FILE}.{os.getpid()}"
        try:
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, self.run_dir / PHASE_FILE)
        except OSError:  # liveness is a convenience: never the reason a run fails
            pass


def read_phase(run_dir: Path) -> dict:
    try:
        rec = json.loads((Path(run_dir) / PHASE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


HEALTH_GROUP = "health"  # the engines' concurrency group of `ping` (train/workers.py declares it)


class EngineProbe:
    """rollout=vllm engines' health, off the step's critical path: a daemon thread calls every watched engine's
    `ping` (in its own concurrency group: answered while a generate call runs) every `period` s. An engine that
    does not answer within `timeout` s (frozen) or whose ping raises (its engine errored) is killed: the driver's
    wait on it then fails at once (ActorDied) and the driver restarts it (train/engines.py EnginePool.recover)."""

    def __init__(self, period: float, timeout: float) -> None:
        self.period, self.timeout = period, timeout
        self.watched: list[Any] = []  # the engines up and refit (the driver sets it; a restarting one is not)
        self.killed: dict[str, str] = {}  # actor id → why the probe killed it
        self.closed = threading.Event()
        threading.Thread(target=self._run, name="grpo-engine-probe", daemon=True).start()

    def close(self) -> None:
        self.closed.set()

    def why(self, handle: Any) -> str | None:
        """Why the probe killed this engine (None: it did not)."""
        return self.killed.get(handle._actor_id.hex())

    def _run(self) -> None:
        while not self.closed.wait(self.period):
            try:
                self.probe(list(self.watched))
            except Exception as exc:  # noqa: BLE001  (Ray going down under it at the run's end; else said, retried)
                if not self.closed.is_set():
                    print(f"grpo-launcher: engine health probe failed ({type(exc).__name__}: {exc}); "
                          "probing again next period", file=sys.stderr, flush=True)

    def probe(self, engines: list[Any]) -> None:
        import ray  # here: see the module docstring

        refs = [e.ping.options(concurrency_group=HEALTH_GROUP).remote() for e in engines]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
        for e, ref in zip(engines, refs):
            if self.closed.is_set():
                return
            if ref in pending:
                reason = f"no answer to a health probe within deadlines.health_timeout_s={self.timeout:g} s"
            else:
                try:
                    ray.get(ref)
                    continue
                except ray.exceptions.RayActorError:  # dead already: the driver's wait finds it
                    continue
                except Exception as exc:  # noqa: BLE001  (the engine's own error: it is restarted)
                    reason = f"health probe failed: {str(exc).strip().splitlines()[-1][:200]}"
            self.killed[e._actor_id.hex()] = reason
            ray.kill(e, no_restart=True)


# ------------------------------------------------------------------ the report


@dataclass(frozen=True)
class ActorInfo:
    role: str  # policy | rollout | env
    rank: int
    pid: int | None
    node: str | None
    node_id: str | None = None  # Ray's: where its stack is taken (stack_on_node)


def actor_info(handle: Any, role: str, rank: int) -> ActorInfo:
    """pid and node of an actor from Ray's GCS (the actor itself is not asked: it may be the stuck one)."""
    import ray  # here: see the module docstring
    from ray._private.state import state

    pid = node = nid = None
    try:
        rec = state.actor_table(handle._actor_id.hex())
        pid = rec.get("Pid") or None
        nid = (rec.get("Address") or {}).get("NodeID")
        for n in ray.nodes():
            if n["NodeID"] == nid:
                node = n.get("NodeManagerHostname") or n.get("NodeManagerAddress")
    except Exception:  # noqa: BLE001 (the report goes on without it)
        pass
    return ActorInfo(role, rank, pid, node, nid)


def stack_on_node(actor: ActorInfo, timeout: float = 30.0) -> str:
    """The actor's stacks taken on its own node: stack_of in a Ray task pinned there (not soft: never another
    node's py-spy on a pid that is not there); here when its node is unknown or Ray is not up."""
    import ray  # here: see the module docstring

    if actor.node_id is None or not ray.is_initialized():
        return stack_of(actor.pid, timeout)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    where = NodeAffinitySchedulingStrategy(actor.node_id, soft=False)
    task = ray.remote(stack_of).options(num_cpus=0, scheduling_strategy=where, max_retries=0)
    try:
        stack = ray.get(task.remote(actor.pid, timeout), timeout=timeout + 60)  # + a worker's start there
        return f"(py-spy run on node {actor.node}, the actor's)\n{stack}"
    except Exception as exc:  # noqa: BLE001 (the report goes on without it)
        return f"(py-spy on node {actor.node} failed: {type(exc).__name__}: {str(exc)[:200]})"


def stack_of(pid: int | None, timeout: float = 30.0) -> str:
    """The process's Python stacks (py-spy dump --nonblocking: a stopped process is read, not attached)."""
    if pid is None:
        return "(no pid known: no stack)"
    exe = shutil.which("py-spy") or _beside_python("py-spy")
    if exe is None:
        return "(py-spy is not installed: no stack; `pip install py-spy` to get one next time)"
    try:
        out = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy dump --pid {pid} failed: {exc})"
    return (out.stdout or out.stderr).strip() or f"(py-spy dump --pid {pid}: no output)"


def _beside_python(name: str) -> str | None:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else None


def hang_report(exc: Hung, actors: list[ActorInfo], last_step: int, checkpoint: str,
                stack: Callable[[ActorInfo], str] = stack_on_node) -> str:
    """The message a hang ends the run with."""
    who = "; ".join(f"{a.role} rank {a.rank} (pid {a.pid}, node {a.node})" for a in actors) or "(no actor named)"
    lines = [f"grpo-launcher: HUNG: {exc}", f"  waiting for: {who}",
             f"  last completed step: {last_step}; last checkpoint: {checkpoint}"]
    for a in actors:
        lines.append(f"  stack of {a.role} rank {a.rank} (pid {a.pid}):")
        lines += ["    " + line for line in stack(a).splitlines()]
    lines.append("  the deadlines are deadlines.factor / floor_s / first_s / window (deadlines.enabled=false: "
                 "no deadline); resume starts from the last checkpoint")
    return "\n".join(lines)
