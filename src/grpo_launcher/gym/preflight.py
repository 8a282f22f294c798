"""env=nemo_gym pre-flight: what can be checked before anything starts (gym/rules.py `gym_preflight`).

* env.gym_overrides items are `dotted.key=value`;
* outside dry runs: the Gym config files exist (absolute, or relative to Gym's install root), every server
  they start has its venv from `make gym`, the data files exist and hold Gym rows (`responses_create_params`,
  `agent_ref`), one agent block per `agent_ref` in the data, and rows with tools have a tool-call parser.
(The async engine + HTTP server is rules.py's `gym_needs_async_http_vllm`; the install itself is
`build_implements_run` through `install.installed()`.)
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Iterator, Optional

import yaml

from ..spec.schema import RunSpec
from .install import GymInstall, find_install, missing_servers

Problem = tuple[tuple[str, ...], str, str]  # (keys, what is wrong, how to fix it)
MAX_ROWS = 100_000


def resolve_config(path: str, inst: Optional[GymInstall]) -> Optional[Path]:
    p = Path(path)
    if p.is_absolute():
        return p if p.is_file() else None
    for root in [Path.cwd(), *([inst.site_root] if inst else [])]:
        if (root / p).is_file():
            return root / p
    return None


def config_blocks(paths: list[Path]) -> dict:
    blocks: dict = {}
    for p in paths:
        data = yaml.safe_load(p.read_text()) or {}
        if isinstance(data, dict):
            blocks.update(data)
    return blocks


def agent_blocks(blocks: dict) -> set[str]:
    return {name for name, b in blocks.items() if isinstance(b, dict) and "responses_api_agents" in b}


def row_agents(path: str) -> tuple[set[str], int, bool, Optional[str]]:
    """(agent names, rows, any row has tools, first problem) of a Gym JSONL file."""
    names: set[str] = set()
    rows, tools = 0, False
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if n > MAX_ROWS:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                return names, rows, tools, f"line {n} is not JSON"
            if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
                return names, rows, tools, f"line {n} has no responses_create_params object"
            ref = row.get("agent_ref")
            name = ref.get("name") if isinstance(ref, dict) else ref
            if not name:
                return names, rows, tools, f"line {n} has no agent_ref (Gym routes each row to the agent it names)"
            names.add(str(name))
            tools = tools or bool(row["responses_create_params"].get("tools"))
            rows += 1
    return names, rows, tools, None


def check(s: RunSpec) -> Iterator[Problem]:
    e = s.env
    for item in e.gym_overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            yield (("env.gym_overrides",), f"item {item!r} is not dotted.key=value",
                   "write each override as server.type.name.key=value, e.g. "
                   "math_with_judge.resources_servers.math_with_judge.should_use_judge=false")
    if e.gym_start_timeout_s <= 0:
        yield (("env.gym_start_timeout_s",), f"must be > 0, got {e.gym_start_timeout_s}", "e.g. 600")


def probe(s: RunSpec) -> Iterator[Problem]:
    """What a real launch needs of this machine (a dry run skips it: the probe-kind rule in gym/rules.py)."""
    e = s.env
    host = str(s.rollout.http_host)
    if getattr(s.cluster.kind, "value", s.cluster.kind) != "local" and s.cluster.nodes > 1 and is_loopback(host):
        yield (("rollout.http_host", "cluster.nodes"),
               f"the engines on nodes 2..{s.cluster.nodes} would serve on {host}, which NeMo Gym's servers (on the "
               "head node) cannot reach",
               "set rollout.http_host=0.0.0.0 (each engine then publishes its node's address; requests need the run's "
               "API key, rollout.http_api_key or a fresh one per run) or cluster.nodes=1")
    inst = find_install()
    blocks: dict = {}
    if inst is not None:
        found = []
        for path in e.gym_config_paths:
            p = resolve_config(path, inst)
            if p is None:
                yield (("env.gym_config_paths",), f"no Gym config {path} (here or under {inst.site_root})",
                       "give a path relative to Gym's install root (resources_servers/<env>/configs/<env>.yaml) "
                       "or an absolute one")
            else:
                found.append(p)
        try:
            blocks = config_blocks(found)
        except Exception as exc:  # noqa: BLE001  (a YAML error is the user's to see)
            yield (("env.gym_config_paths",), f"cannot read the Gym configs: {exc}", "fix the YAML")
        lacking = missing_servers(inst, blocks)
        if lacking:
            yield (("env.gym_config_paths",), f"`make gym` did not install these servers: {', '.join(lacking)}",
                   "add them to SERVERS in scripts/gym-install.sh and run `make gym` again")
    agents = agent_blocks(blocks)
    for key in ("train_path", "val_path"):
        path = getattr(e, key)
        if key == "train_path" and not path:
            yield (("env.train_path",), "env=nemo_gym needs Gym rows to train on", "point env.train_path at a Gym JSONL file")
            continue
        if not path or not Path(path).is_file():
            continue  # a missing file is local_paths_exist's to report
        names, rows, tools, problem = row_agents(path)
        if problem:
            yield ((f"env.{key}",), f"{path}: {problem}", "each line: a Gym row with responses_create_params and agent_ref")
            continue
        if key == "train_path" and rows == 0:
            yield ((f"env.{key}",), f"{path} holds no rows", "point it at a non-empty Gym JSONL file")
        if blocks and names - agents:
            yield ((f"env.{key}", "env.gym_config_paths"),
                   f"{path} routes rows to {', '.join(sorted(names - agents))}, which no config in env.gym_config_paths "
                   f"defines (agents there: {', '.join(sorted(agents)) or 'none'})",
                   "add the environment's config (resources_servers/<env>/configs/<env>.yaml) to env.gym_config_paths")
        if tools and not e.gym_tool_call_parser:
            yield ((f"env.{key}", "env.gym_tool_call_parser"),
                   f"{path} has rows with tools, and vLLM answers 400 to tool requests without a tool-call parser",
                   "set env.gym_tool_call_parser (e.g. pythonic, hermes, qwen3_coder: the model's format)")


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
