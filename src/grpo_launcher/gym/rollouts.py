"""Rollouts through Gym's agents: every row → `POST <agent>/run`, all in flight at once, results in input order.

Each row is the Gym JSONL row as is (env-specific fields pass through) with `responses_create_params`
stamped from the spec the way NeMo-RL's `run_async_nemo_gym_rollout` does: temperature, top_p,
max_output_tokens = min(row's, rollout.max_new_tokens). The agent is the block named by `row.agent_ref.name`.
A row the agent rejects (HTTP error, malformed result) becomes a failed sample (masked, counted, logged),
never a dropped one; a Gym server that dies fails the call naming it (GymServerDied), without waiting for
the other requests.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import aiohttp

from .samples import GymGeneration, failed_generation, to_generation
from .servers import GymError


@dataclass
class RolloutStats:
    rollouts: int = 0
    failed: int = 0  # the agent rejected the row or returned something unusable
    non_contiguous: int = 0  # multi-turn samples whose turns do not extend each other's tokens
    masked_by_env: int = 0  # Gym's mask_sample
    turns: int = 0
    seconds: float = 0.0
    errors: list = field(default_factory=list)  # (agent, message), first few

    def metrics(self, prefix: str = "gym") -> dict[str, float]:
        n = max(self.rollouts, 1)
        return {f"{prefix}/rollouts": float(self.rollouts), f"{prefix}/failed_rollouts": float(self.failed),
                f"{prefix}/non_contiguous_samples": float(self.non_contiguous),
                f"{prefix}/env_masked_samples": float(self.masked_by_env),
                f"{prefix}/turns_mean": self.turns / n, f"{prefix}/rollouts_per_s": self.rollouts / max(self.seconds, 1e-9)}


def stamp_row(row: dict, temperature: float, top_p: float, max_new_tokens: int) -> dict:
    """A copy of `row` with the sampling parameters the trainer owns (Gym has no top_k / stop strings)."""
    out = copy.deepcopy(row)
    params = out.setdefault("responses_create_params", {})
    params["temperature"] = temperature
    params["top_p"] = top_p
    own = params.get("max_output_tokens")
    params["max_output_tokens"] = min(int(own), max_new_tokens) if own else max_new_tokens
    return out


def agent_name(row: dict) -> str:
    ref = row.get("agent_ref") or {}
    return str(ref.get("name", "")) if isinstance(ref, dict) else str(ref)


async def _post_run(session, url: str, row: dict, timeout_s: float) -> dict:
    async with session.post(f"{url}/run", json=row, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        body = await r.text()
        if r.status != 200:
            raise GymError(f"HTTP {r.status} from {url}/run: {body[:300]}")
        try:
            return json.loads(body)
        except ValueError as exc:
            raise GymError(f"{url}/run returned no JSON: {body[:200]}") from exc


async def _run_all(rows: list[dict], agents: dict[str, str], check: Callable[[], None], timeout_s: float,
                   concurrency: int, max_model_len: Optional[int]) -> list[GymGeneration]:
    sem = asyncio.Semaphore(concurrency)
    out: list[Optional[GymGeneration]] = [None] * len(rows)
    conn = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, force_close=False)
    # cookies carry Gym's session state between the agent's calls; each rollout is its own session
    async with aiohttp.ClientSession(connector=conn, cookie_jar=aiohttp.DummyCookieJar()) as session:

        async def one(i: int, row: dict) -> None:
            name = agent_name(row)
            url = agents.get(name)
            if url is None:
                out[i] = failed_generation(row, f"no agent named {name!r} (agents: {', '.join(sorted(agents))})")
                return
            async with sem:
                try:
                    result = await _post_run(session, url, row, timeout_s)
                except (GymError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    check()  # a dead server is the run's error, not this row's
                    out[i] = failed_generation(row, f"{name}: {type(exc).__name__}: {exc}")
                    return
            out[i] = to_generation(result, row, max_model_len)

        async def watchdog() -> None:
            while True:
                await asyncio.sleep(1.0)
                check()

        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(rows)]
        dog = asyncio.ensure_future(watchdog())
        try:
            done = asyncio.gather(*tasks)
            finished, _ = await asyncio.wait({done, dog}, return_when=asyncio.FIRST_COMPLETED)
            if dog in finished:
                dog.result()  # raises GymServerDied
            done.result()
        finally:
            dog.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, dog, return_exceptions=True)
    return out  # type: ignore[return-value]


def run_rollouts(rows: list[dict], agents: dict[str, str], check: Callable[[], None] = lambda: None,
                 timeout_s: float = 900.0, concurrency: int = 256, max_model_len: Optional[int] = None,
                 stats: Optional[RolloutStats] = None, log_path: Optional[Path] = None) -> list[GymGeneration]:
    """All rows through their agents concurrently; one GymGeneration per row, in row order."""
    t0 = time.perf_counter()
    gens = asyncio.run(_run_all(rows, agents, check, timeout_s, concurrency, max_model_len))
    if stats is not None:
        stats.seconds += time.perf_counter() - t0
        stats.rollouts += len(gens)
        for g in gens:
            stats.turns += g.turns
            stats.failed += bool(g.failed)
            stats.non_contiguous += not g.contiguous
            stats.masked_by_env += g.mask_sample
            if g.failed and len(stats.errors) < 20:
                stats.errors.append((g.agent_ref, g.failed))
    if log_path is not None:
        bad = [g for g in gens if g.failed or not g.contiguous]
        if bad:
            with open(log_path, "a") as f:
                for g in bad:
                    f.write(json.dumps({"agent_ref": g.agent_ref, "failed": g.failed, "contiguous": g.contiguous,
                                        "turns": g.turns}) + "\n")
    return gens
