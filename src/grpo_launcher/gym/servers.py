"""NeMo Gym's servers for one run: config written, `gym env start` started, readiness awaited, stopped by PID.

    servers = GymServers.start(spec, workdir, base_urls, api_key)   # head + resources + agents + policy_model
    servers.agents()        # {agent name: "http://127.0.0.1:port"} from the head's resolved config
    servers.check()         # raises GymServerDied naming the server whose process is gone
    servers.stop()          # SIGTERM to the process group, SIGKILL after a grace period

Everything binds to loopback (Gym's default_host, the head server) unless env.gym_host says otherwise; Gym's
own Ray gets a private RAY_TMPDIR (it would otherwise join whatever cluster Ray's temp dir names, e.g. the
trainer's, which runs another Python and cannot be shared: shared/reference/nemo-gym.md §2). `gym env start`
runs in its own session (process group), so stopping it by its PID group reaches every server and its Ray.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import requests
import yaml

from ..deadlines import ActorInfo, Hung, stack_of
from ..runfiles import pid_alive
from .install import GymInstall, find_install


class GymError(RuntimeError):
    pass


class GymNotInstalled(GymError):
    pass


class GymServerDied(GymError):
    pass


class GymStartTimeout(GymError):
    pass


class GymServerHung(Hung):
    """A Gym server gave no answer to its health probe (frozen): the run ends as a hang does (exit 4), naming it;
    `actors` is the server, described for the report, and `stack` its stack, taken when it was found (Gym runs on
    the driver's node; its servers are stopped before the report is written)."""

    def __init__(self, message: str, server: ActorInfo) -> None:
        Exception.__init__(self, message)
        self.phase, self.step, self.waited, self.how, self.owners = "generate", 0, 0.0, "", []
        self.actors = [server]
        self.stack = stack_of(server.pid)


def free_port(host: str = "127.0.0.1", low: int = 0, high: int = 0) -> int:
    """A port nobody holds now: the kernel's pick (low=0), or a random one in [low, high]."""
    for _ in range(200 if low else 1):
        port = random.randint(low, high) if low else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise GymError(f"no free port in {low}-{high} on {host}")


# The head's port is picked before `gym env start` binds it, seconds later (Ray starts first): outside the
# ephemeral range (32768+, where Ray's and everyone's outgoing sockets land), Ray's worker ports (10002-19999)
# and the servers' range below.
HEAD_PORTS = (30000, 32700)
SERVER_PORTS = (20001, 29999)


def gym_config(config_paths: list[str], base_urls: list[str], model: str, api_key: Optional[str], host: str,
               head_port: int, server_venvs: Path, overrides: Optional[list[str]] = None) -> dict:
    """The dict Gym reads as env.yaml (merged over its config_paths): our engines are the policy model."""
    cfg = {
        "config_paths": list(config_paths),
        "policy_base_url": list(base_urls),  # one entry per engine: Gym keeps each session on one of them
        "policy_model_name": model,
        "policy_api_key": api_key or "dummy_key",
        "default_host": host,
        "head_server": {"host": host, "port": head_port},
        "skip_venv_if_present": True,  # `make gym` built one shared venv; Gym's per-server uv venvs link to it
        "uv_venv_dir": str(server_venvs),
        "port_range_low": SERVER_PORTS[0],  # the servers' random ports (Gym picks them)
        "port_range_high": SERVER_PORTS[1],
    }
    for item in overrides or []:  # env.gym_overrides: "a.b.c=value" (NeMo-RL's per-server overrides)
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise GymError(f"env.gym_overrides item {item!r} is not dotted.key=value")
        value = yaml.safe_load(raw)
        node = cfg
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return cfg


@dataclass
class GymServers:
    inst: GymInstall
    workdir: Path
    proc: subprocess.Popen
    head_url: str
    log_path: Path
    instances: list = field(default_factory=list)  # /server_instances: name, server_type, pid, url
    _log: object = None
    stopped: bool = False
    ray_tmp: Optional[Path] = None
    frozen: Optional[GymServerHung] = None  # what the health probe found (watch), raised by check()

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, config_paths: list[str], base_urls: list[str], model: str, workdir: Path,
              api_key: Optional[str] = None, host: str = "127.0.0.1", timeout_s: float = 600.0,
              overrides: Optional[list[str]] = None, inst: Optional[GymInstall] = None,
              abort: Optional[Callable[[], bool]] = None) -> "GymServers":
        inst = inst or find_install()
        if inst is None:
            raise GymNotInstalled("NeMo Gym's environment is not installed: run `make gym` (scripts/gym-install.sh)")
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        head_port = free_port(host, *HEAD_PORTS)
        cfg = gym_config(config_paths, base_urls, model, api_key, host, head_port, inst.server_venvs, overrides)
        (workdir / "env.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        os.chmod(workdir / "env.yaml", 0o600)  # it may hold the engines' API key
        ray_tmp = Path("/tmp") / f"gym-ray-{os.getpid()}-{head_port}"  # short: Ray's socket paths are length-capped
        ray_tmp.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CUDA_VISIBLE"))}
        env.update({"RAY_TMPDIR": str(ray_tmp), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    "RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{inst.bin}{os.pathsep}{env.get('PATH', '')}",
                    "VIRTUAL_ENV": str(inst.python.parent.parent), "PYTHONUNBUFFERED": "1",
                    "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"})
        log_path = workdir / "gym.log"
        log = open(log_path, "wb")
        proc = subprocess.Popen([str(inst.bin / "gym"), "env", "start"], cwd=workdir, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent)
        # "PID HOST": launch/job.sh stops a Gym the driver left behind by this PID, on this host only
        (workdir / "gym.pid").write_text(f"{proc.pid} {socket.gethostname()}\n")
        self = cls(inst=inst, workdir=workdir, proc=proc, head_url=f"http://{_url_host(host)}:{head_port}",
                   log_path=log_path, _log=log, ray_tmp=ray_tmp)
        try:
            self.wait_ready(timeout_s, abort)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float, abort: Optional[Callable[[], bool]] = None) -> None:
        """Until the head's /readyz is 200 (every server and model endpoint up). On timeout, the error names
        the servers that did not answer; if `gym env start` exits first, the error carries its log's tail;
        `abort()` true (the run was asked to stop) ends the wait at once."""
        deadline = time.monotonic() + timeout_s
        port = self.head_url.rsplit(":", 1)[1]
        while True:
            if self.proc.poll() is not None:
                raise GymServerDied(f"`gym env start` exited with code {self.proc.returncode} during start-up; "
                                    f"last lines of {self.log_path}:\n{self.log_tail()}")
            if abort is not None and abort():
                raise GymError("stop requested while NeMo Gym was starting")
            if f"{port}): address already in use" in self.log_tail(60):  # Gym would wait for its head forever
                raise GymError(f"NeMo Gym's head server could not bind {self.head_url} (address already in use)")
            try:
                if requests.get(f"{self.head_url}/readyz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                down = self._not_up()
                raise GymStartTimeout(
                    f"NeMo Gym did not come up within {timeout_s:.0f} s: "
                    + (f"not ready: {', '.join(down)}" if down else "the head server never answered")
                    + f"; last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(1.0)
        self.instances = self._server_instances()

    def _server_instances(self) -> list:
        try:
            data = requests.get(f"{self.head_url}/server_instances", timeout=10).json()
        except (requests.RequestException, ValueError):
            return []
        return data if isinstance(data, list) else data.get("server_instances", [])

    def _not_up(self) -> list[str]:
        """Names of the servers (and model endpoints) that do not answer yet, for the timeout message."""
        try:
            requests.get(f"{self.head_url}/health", timeout=5)
        except requests.RequestException:
            return ["head server"]
        down = []
        for inst in self._server_instances():
            url = inst.get("url")
            name = f"{inst.get('process_name') or inst.get('name')} ({inst.get('server_type')})"
            if not url:
                down.append(name)
                continue
            try:
                requests.get(url, timeout=5)
            except requests.RequestException:
                down.append(name)
        try:
            for url in self.policy_urls():
                try:
                    requests.get(url.rstrip("/") + "/models", timeout=5)
                except requests.RequestException:
                    down.append(f"policy model endpoint {url}")
        except Exception:  # noqa: BLE001  (best effort: the message still names the servers)
            pass
        return down or ["the head server's readiness check (/readyz)"]

    # ------------------------------------------------------------------ while running
    def resolved_config(self) -> dict:
        """The head's resolved global config (GET /global_config_dict_yaml: a JSON string of the YAML)."""
        r = requests.get(f"{self.head_url}/global_config_dict_yaml", timeout=30)
        r.raise_for_status()
        text = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
        return yaml.safe_load(text) if isinstance(text, str) else text

    def agents(self) -> dict[str, str]:
        """{agent block name: base URL} for every responses_api_agents block."""
        out = {}
        for name, block in self.resolved_config().items():
            if isinstance(block, dict) and isinstance(block.get("responses_api_agents"), dict):
                for _, cfg in block["responses_api_agents"].items():
                    if isinstance(cfg, dict) and cfg.get("port"):
                        out[name] = f"http://{_url_host(cfg.get('host') or '127.0.0.1')}:{cfg['port']}"
        return out

    def policy_urls(self) -> list[str]:
        urls = yaml.safe_load((self.workdir / "env.yaml").read_text()).get("policy_base_url") or []
        return [urls] if isinstance(urls, str) else list(urls)

    def watch(self, period_s: float, timeout_s: float) -> None:
        """Probe the servers from a daemon thread every period_s (off the rollouts' path): one that does not answer
        an HTTP GET within timeout_s is frozen, and the next check() raises GymServerHung naming it."""
        def run() -> None:
            while not self.stopped and self.frozen is None:
                time.sleep(period_s)
                if not self.stopped:
                    self.frozen = self.probe(timeout_s)

        if period_s > 0:
            threading.Thread(target=run, name="grpo-gym-probe", daemon=True).start()

    def probe(self, timeout_s: float) -> Optional[GymServerHung]:
        """The first server (head included) that accepts a connection but gives no answer within timeout_s."""
        servers = [("head server", f"{self.head_url}/health", self.proc.pid),
                   *((f"{i.get('process_name') or i.get('name')} ({i.get('server_type')})", i.get("url"),
                      i.get("pid")) for i in self.instances if i.get("url"))]
        for name, url, pid in servers:
            try:
                requests.get(url, timeout=timeout_s)
            except requests.Timeout:
                return GymServerHung(f"NeMo Gym server {name!r} (pid {pid}, {url}) gave no answer to a health "
                                     f"probe within deadlines.health_timeout_s={timeout_s:g} s",
                                     ActorInfo("gym server", 0, int(pid) if pid else None, socket.gethostname()))
            except requests.RequestException:  # refused: it died, which check() names by its pid
                continue
        return None

    def check(self) -> None:
        """Raise GymServerDied naming what is gone: `gym env start` itself, or one of its servers; GymServerHung
        naming one the health probe (watch) found frozen."""
        if self.stopped:
            return
        if self.frozen is not None:
            raise self.frozen
        if self.proc.poll() is not None:
            raise GymServerDied(f"NeMo Gym (`gym env start`, pid {self.proc.pid}) exited with code "
                                f"{self.proc.returncode}; last lines of {self.log_path}:\n{self.log_tail()}")
        for inst in self.instances:
            pid = inst.get("pid")
            if pid and not _pid_alive(int(pid)):
                raise GymServerDied(
                    f"NeMo Gym server {inst.get('process_name') or inst.get('name')!r} "
                    f"({inst.get('server_type')}/{inst.get('name')}, pid {pid}) died; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    # ------------------------------------------------------------------ stop
    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to `gym env start`'s process group (servers, Gym's Ray), SIGKILL what is left after grace_s.
        (SIGINT is not used: a non-interactive start inherits it ignored.)"""
        if self.stopped:
            return
        self.stopped = True
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        server_pids = [int(i["pid"]) for i in self.instances if i.get("pid")]
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (_group_alive(pgid) or any(map(_pid_alive, server_pids))):
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)  # whatever ignored SIGTERM (Ray's workers, a hung server)
        for pid in server_pids:  # a server that left the group (setsid) is still ours
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self._log is not None:
            self._log.close()
        if self.ray_tmp is not None:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
        (self.workdir / "gym.pid").unlink(missing_ok=True)

    def __enter__(self) -> "GymServers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the trainer dies, even by SIGKILL (`gym env start` then stops its
    servers and its Ray itself), so a crashed run leaves no Gym behind. Linux only; elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        host = socket.gethostbyname(socket.gethostname())
    return f"[{host}]" if ":" in host else host


def _pid_alive(pid: int) -> bool:
    if not pid_alive(pid):
        return False
    try:  # a zombie (exited, not yet reaped) is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
