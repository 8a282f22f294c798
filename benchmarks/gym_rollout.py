"""Rollouts/s through NeMo Gym vs direct engine calls, same engine, same prompts (the HTTP path's overhead).

    .venv/bin/python benchmarks/gym_rollout.py [--prompts 8] [--n 8] [--new-tokens 16] [--repeats 3] [--out FILE]

One VLLMRolloutWorker (async engine + OpenAI HTTP server, the tiny model, refit from its HF weights) serves both:
* direct: `worker.generate(prompt_ids, n)` on the chat-templated prompts (what env=math/toy do);
* Gym: `gym env start` (math_with_judge + example_single_tool_call) over the worker's URL, rows → `/run`.
Needs `make gym`. Prints a Markdown table; --out appends it (benchmarks/results/gym_rollout.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from grpo_launcher.train.gym_probe import CONFIGS, tiny_engine, tiny_spec
    from grpo_launcher.gym.rollouts import RolloutStats, run_rollouts, stamp_row
    from grpo_launcher.gym.servers import GymServers

    work = Path(tempfile.mkdtemp(prefix="h14-gym-bench-"))
    t0 = time.perf_counter()
    spec = tiny_spec(REPO / "outputs", a.new_tokens)
    model_dir, worker, env = tiny_engine(spec)
    t_engine = time.perf_counter() - t0
    servers = None
    try:
        t1 = time.perf_counter()
        servers = GymServers.start(CONFIGS, [worker.http_url()], spec.model.name, work / "gym")
        t_gym = time.perf_counter() - t1
        agents = servers.agents()
        prompts = env.train_prompts(1, 0, a.prompts)
        rows = [stamp_row(p.row, 1.0, 1.0, a.new_tokens) for p in prompts for _ in range(a.n)]
        warm = run_rollouts(rows, agents, servers.check)  # warm-up (first requests compile / fill caches)
        # the direct path gets the very prompt ids Gym's rollouts started from (chat template applied by vLLM)
        ids = [warm[k * a.n].prompt_ids for k in range(len(prompts))]
        tok = AutoTokenizer.from_pretrained(model_dir)
        from grpo_launcher.gym.serving import CHATML

        text = [tok.apply_chat_template(p.row["responses_create_params"]["input"], chat_template=CHATML.read_text(),
                                        add_generation_prompt=True, tokenize=False) for p in prompts]
        same = sum(tok(t, add_special_tokens=False)["input_ids"] == i for t, i in zip(text, ids))
        worker.generate(ids, a.n, seed=0)
        gym_s, direct_s, toks_gym, toks_direct, stats = [], [], 0, 0, RolloutStats()
        for r in range(a.repeats):
            t = time.perf_counter()
            gens = run_rollouts(rows, agents, servers.check, stats=stats)
            gym_s.append(time.perf_counter() - t)
            toks_gym += sum(sum(g.loss_mask) for g in gens)
            t = time.perf_counter()
            dg = worker.generate(ids, a.n, seed=r + 1)
            direct_s.append(time.perf_counter() - t)
            toks_direct += sum(len(g.response_ids) for g in dg)
        B = len(rows)
        best_g, best_d = min(gym_s), min(direct_s)
        table = [
            f"| path | rollouts/batch | best batch s | rollouts/s | gen tokens/s |",
            "|---|---|---|---|---|",
            f"| direct engine (`generate`, n={a.n} per prompt) | {B} | {best_d:.2f} | {B / best_d:.1f} | "
            f"{toks_direct / sum(direct_s):.0f} |",
            f"| NeMo Gym `/run` (one row per sample) | {B} | {best_g:.2f} | {B / best_g:.1f} | "
            f"{toks_gym / sum(gym_s):.0f} |",
        ]
        info = {"prompts": a.prompts, "n": a.n, "max_new_tokens": a.new_tokens, "repeats": a.repeats,
                "engine_start_s": round(t_engine, 1), "gym_start_s": round(t_gym, 1),
                "gym_over_direct": round(best_g / best_d, 2), "failed": stats.failed,
                "turns_mean": round(stats.turns / max(stats.rollouts, 1), 2), "agents": sorted(agents),
                "prompt_ids_equal_hf_chat_template": f"{same}/{len(ids)}"}
        text = "\n".join(table) + f"\n\n`{json.dumps(info)}`\n"
        print(text)
        if a.out:
            with open(a.out, "a") as f:
                f.write(text + "\n")
    finally:
        if servers is not None:
            servers.stop()
        worker.shutdown()


if __name__ == "__main__":  # the engine's processes re-import this file
    main()
