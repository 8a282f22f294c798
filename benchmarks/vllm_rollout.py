#!/usr/bin/env python
"""rollout=vllm overhead, in one run: our Ray-wrapped engines vs bare `vllm.LLM` on the same prompts and model.

    .venv/bin/python benchmarks/vllm_rollout.py            (~3 min on 2 cores; results/vllm_rollout.md has a run)

Engines (all float32, eager, 64 MiB KV, the tiny model, same SamplingParams incl. per-prompt seeds):
  bare   vllm.LLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), weights loaded from disk
  sync   VLLMRolloutWorker in a Ray actor, as the driver places it (rollout=vllm)
  async  VLLMRolloutWorker with rollout.async_engine=true + expose_http_server=true (AsyncLLM, EngineCore process)
Workloads: "toy" = one GRPO step's rollout (16 prompts × 8, answers end with EOS after ~5 tokens);
"long" = the same prompts on fresh random weights (near-uniform next tokens: most samples run to max_new_tokens,
decode-bound).
Rounds alternate between engines (never two at once); tokens/s is generated tokens / wall time of the call as
the driver sees it (Ray round trip and Generation objects included for ours). Refit: `update_weights` with
the state dict in the object store, as driver.refit does (median of N); the in-actor ms is what it returns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10, help="timed generate calls per engine and workload")
    ap.add_argument("--refits", type=int, default=30, help="timed refits per engine")
    ap.add_argument("--verbose", action="store_true", help="print every round")
    ap.add_argument("--cache", default=str(ROOT / "outputs" / ".models"), help="tiny-model cache (launch.py's)")
    a = ap.parse_args()

    from grpo_launcher.train.workers import WORKER_ENV, _src

    for k, v in WORKER_ENV.items():
        os.environ.setdefault(k, v)  # the same engine environment as the actors (in-process, loopback)

    import psutil
    import ray
    import torch

    from grpo_launcher.envs import make_env
    from grpo_launcher.models.tiny import ensure_tiny_model
    from grpo_launcher.rollout import rollout_class
    from grpo_launcher.spec.compose import load_spec

    T = a.max_new_tokens
    common = ["rollout=vllm", f"rollout.max_new_tokens={T}", f"train.max_total_sequence_length={8 + T}"]
    spec = load_spec(common)
    spec_async = load_spec([*common, "rollout.async_engine=true", "rollout.expose_http_server=true"])
    env = make_env(spec)
    Path(a.cache).mkdir(parents=True, exist_ok=True)
    model_dir = str(ensure_tiny_model(spec.model, env, "toy", Path(a.cache)))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    g = torch.Generator().manual_seed(0)  # "long": fresh random weights: near-uniform tokens, EOS rarely
    no_eos = {k: torch.ones_like(v) if "norm" in k else torch.zeros_like(v) if k.endswith("bias")
              else 0.02 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    prompts = [tok(p.text)["input_ids"] for p in env.train_prompts(1, 0, a.prompts)]
    print(f"model {model_dir}\nprompts {a.prompts} × n={a.n}, max_new_tokens={T}, rounds={a.rounds}, "
          f"refits={a.refits}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

    # ---------------------------------------------------------------- start-up
    t0 = time.perf_counter()
    import vllm  # noqa: F401

    import_s = time.perf_counter() - t0
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    from grpo_launcher.rollout.vllm import sampling_params

    me = psutil.Process()
    rss0 = me.memory_info().rss
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype="float32", max_model_len=8 + T, seed=0, enforce_eager=True,
              kv_cache_memory_bytes=spec.rollout.kv_cache_memory_mb * 2**20, skip_tokenizer_init=True,
              logprobs_mode="processed_logprobs", disable_log_stats=True)
    bare_start = time.perf_counter() - t0
    bare_rss = me.memory_info().rss

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20, logging_level="WARNING",
             runtime_env={"env_vars": dict(WORKER_ENV, PYTHONPATH=_src())})
    R = ray.remote(rollout_class("vllm"))
    actors, ready_s = {}, {}
    for name, s in (("sync", spec), ("async", spec_async)):  # one at a time: start-up times are not shared
        t0 = time.perf_counter()
        actors[name] = R.options(num_cpus=0.5).remote(s, model_dir, 1)
        ray.get(actors[name].info.remote(), timeout=900)
        ready_s[name] = time.perf_counter() - t0
    ref_base, ref_no_eos = ray.put(base), ray.put(no_eos)
    ray.get([x.update_weights.remote(ref_base) for x in actors.values()])  # dummy → real, as the driver does
    info = {k: ray.get(x.info.remote()) for k, x in actors.items()}

    def bare_generate(seed: int):
        params = sampling_params(spec, a.n, seed, len(prompts), [tok.eos_token_id])
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]

    def ours(name: str):
        return lambda seed: [g.response_ids for g in ray.get(actors[name].generate.remote(prompts, a.n, seed))]

    engines = {"bare": bare_generate, "sync": ours("sync"), "async": ours("async")}

    def set_weights(state, ref) -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items()),
                                                     "is_checkpoint_format": True})
        llm.reset_prefix_cache()
        ray.get([x.update_weights.remote(ref) for x in actors.values()])

    results: dict[tuple[str, str], list[float]] = {}
    identical = {}
    for workload, state, ref in (("toy", base, ref_base), ("long", no_eos, ref_no_eos)):
        set_weights(state, ref)
        for name, gen in engines.items():
            gen(999)  # warm-up: the first eager call of a shape is slow
        outs = {name: gen(7) for name, gen in engines.items()}
        identical[workload] = {name: outs[name] == outs["bare"] for name in ("sync", "async")}
        for r in range(a.rounds):
            for name, gen in engines.items():
                t0 = time.perf_counter()
                toks = sum(map(len, gen(r)))
                results.setdefault((workload, name), []).append(toks / (time.perf_counter() - t0))
                if a.verbose:
                    print(f"{workload} round {r} {name}: {toks} tokens, {results[(workload, name)][-1]:,.0f} tok/s",
                          flush=True)

    # ---------------------------------------------------------------- refit
    refit = {}
    for name, actor in actors.items():
        inside, outside = [], []
        for _ in range(a.refits):
            t0 = time.perf_counter()
            inside.append(ray.get(actor.update_weights.remote(ref_base)))
            outside.append((time.perf_counter() - t0) * 1e3)
        refit[name] = (statistics.median(inside), statistics.median(outside))
    bare_refit = []
    for _ in range(a.refits):
        t0 = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(base.items()),
                                                     "is_checkpoint_format": True})
        llm.reset_prefix_cache()
        bare_refit.append((time.perf_counter() - t0) * 1e3)

    # ---------------------------------------------------------------- report
    print(f"\n`import vllm` {import_s:.1f} s (this process)\n")
    print("| engine | start-up | RSS (process tree) | processes |")
    print("|---|---|---|---|")
    print(f"| bare vllm.LLM (in-process) | {bare_start:.1f} s (LLM() only) | +{(bare_rss - rss0) / 2**20:.0f} MiB "
          f"for LLM() (this process {bare_rss / 2**20:.0f} MiB) | 1 |")
    for name in actors:
        i = info[name]
        print(f"| {name} (Ray actor) | {i['startup_s']:.1f} s in the actor (incl. import vllm), "
              f"{ready_s[name]:.1f} s actor ready | {i['rss_mb']:.0f} MiB | {i['processes']} |")
    print("\n| workload | engine | tokens/s (median of rounds) | ratio vs bare | same tokens as bare |")
    print("|---|---|---|---|---|")
    for workload in ("toy", "long"):
        b = statistics.median(results[(workload, "bare")])
        for name in engines:
            m = statistics.median(results[(workload, name)])
            same = "—" if name == "bare" else identical[workload][name]
            print(f"| {workload} | {name} | {m:,.0f} | {m / b:.2f} | {same} |")
    print("\n| refit | median ms in the engine | median ms as the driver sees it (ray.get) |")
    print("|---|---|---|")
    print(f"| bare LLM reload_weights + reset_prefix_cache | {statistics.median(bare_refit):.1f} | — |")
    for name, (inside, outside) in refit.items():
        print(f"| {name} update_weights | {inside:.1f} | {outside:.1f} |")

    ray.get([x.shutdown.remote() for x in actors.values()], timeout=300)
    for x in actors.values():
        ray.kill(x)
    ray.shutdown()
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":  # vLLM spawns processes (the async engine's EngineCore): keep the guard
    main()
