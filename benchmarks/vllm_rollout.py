#!/usr/bin/env python
"""rollout=vllm overhead, in one run: our Ray-wrapped engines vs bare `vllm.LLM` on the same prompts and model.

    .venv/bin/python benchmarks/vllm_rollout.py            (~3 min on 2 cores; results/vllm_rollout.md has runs)

Engines (all float32, eager, 64 MiB KV, the tiny model, the same SamplingParams incl. per-prompt seeds):
  bare      vllm.LLM in this process, in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
  bare-mp   vllm.LLM in this process with its engine core in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1)
  sync      VLLMRolloutWorker in a Ray actor exactly as the driver makes it (rollout=vllm; workers.py's env: in-process)
  sync-mp   the same with VLLM_ENABLE_V1_MULTIPROCESSING=1 in the actor (refit crosses the process as bytes)
  async     rollout.async_engine=true + expose_http_server=true (AsyncLLM; its EngineCore is always a child process)
Each of ours is compared with the bare engine of the same process layout: sync/bare, sync-mp/bare-mp, async/bare-mp.
Workloads: "toy" = one GRPO step's rollout (16 prompts × 8; answers end with EOS after ~5 tokens);
"long" = the same prompts on fresh random weights (near-uniform next tokens: most samples run to max_new_tokens).
Rounds rotate the engine order and never run two engines at once; tokens/s = generated tokens / wall time of the
call as the caller sees it (for ours: the Ray round trip and the Generation objects included). Refit: the driver's
call, `update_weights` with the state dict in the object store (median of N; in-engine ms is its return value).
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
PAIRS = {"bare": "bare", "sync": "bare", "bare-mp": "bare-mp", "sync-mp": "bare-mp", "async": "bare-mp"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8, help="timed generate calls per engine and workload")
    ap.add_argument("--refits", type=int, default=30, help="timed refits per engine")
    ap.add_argument("--engines", default="bare,sync,bare-mp,sync-mp,async",
                    help="comma list; an engine of ours needs its bare partner (sync→bare, sync-mp/async→bare-mp)")
    ap.add_argument("--verbose", action="store_true", help="print every round")
    ap.add_argument("--cache", default=str(ROOT / "outputs" / ".models"), help="tiny-model cache (launch.py's)")
    a = ap.parse_args()

    from grpo_launcher.train.workers import WORKER_ENV, _src

    for k, v in WORKER_ENV.items():
        os.environ.setdefault(k, v)  # the actors' engine environment (in-process, loopback)

    import psutil
    import ray
    import torch

    from grpo_launcher.envs import make_env
    from grpo_launcher.models.tiny import ensure_tiny_model
    from grpo_launcher.rollout import rollout_class
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.stop_tokens import stop_token_ids

    T = a.max_new_tokens
    want = a.engines.split(",")
    assert all(w in PAIRS and PAIRS[w] in want for w in want), f"--engines {a.engines}: see --help"
    common = ["rollout=vllm", f"rollout.max_new_tokens={T}", f"train.max_total_sequence_length={8 + T}"]
    spec = load_spec(common)
    spec_async = load_spec([*common, "rollout.async_engine=true", "rollout.expose_http_server=true"])
    env = make_env(spec)
    Path(a.cache).mkdir(parents=True, exist_ok=True)
    model_dir = str(ensure_tiny_model(spec.model, env, "toy", Path(a.cache)))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    stop_ids = list(stop_token_ids(model_dir, tok))  # the stop set the workers use (stop_tokens.py)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    g = torch.Generator().manual_seed(0)  # "long": fresh random weights: near-uniform tokens, EOS rarely
    rand = {k: torch.ones_like(v) if "norm" in k else torch.zeros_like(v) if k.endswith("bias")
            else 0.02 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    prompts = [tok(p.text)["input_ids"] for p in env.train_prompts(1, 0, a.prompts)]
    load0 = os.getloadavg()[0]
    print(f"model {model_dir}\nprompts {a.prompts} × n={a.n}, max_new_tokens={T}, rounds={a.rounds}, "
          f"refits={a.refits}; load average {load0:.1f} on {os.cpu_count()} CPUs at the start", flush=True)

    # ---------------------------------------------------------------- start-up (one engine at a time)
    t0 = time.perf_counter()
    import vllm  # noqa: F401

    import_s = time.perf_counter() - t0
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    from grpo_launcher.rollout.vllm import EXTENSION, _to_bytes, kv_cache_bytes, sampling_params

    me = psutil.Process()
    bare, startup, rss = {}, {}, {}
    for name, mp in [(n, m) for n, m in (("bare", "0"), ("bare-mp", "1")) if n in want]:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = mp  # read when the engine is built
        before = {p.pid for p in me.children(recursive=True)}
        rss0, t0 = me.memory_info().rss, time.perf_counter()
        bare[name] = LLM(model=model_dir, dtype="float32", max_model_len=8 + T, seed=0, enforce_eager=True,
                         kv_cache_memory_bytes=kv_cache_bytes(spec, None), skip_tokenizer_init=True,
                         logprobs_mode="processed_logprobs", disable_log_stats=True,
                         worker_extension_cls=EXTENSION)  # bare-mp can only take weights as bytes
        startup[name] = f"{time.perf_counter() - t0:.1f} s (LLM() only)"
        kids = [p for p in me.children(recursive=True) if p.pid not in before]
        rss[name] = (me.memory_info().rss - rss0 + sum(p.memory_info().rss for p in kids)) / 2**20, 1 + len(kids)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = WORKER_ENV["VLLM_ENABLE_V1_MULTIPROCESSING"]

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20, logging_level="WARNING",
             runtime_env={"env_vars": dict(WORKER_ENV, PYTHONPATH=_src())})
    R = ray.remote(rollout_class("vllm"))
    actors = {}
    mp_env = {"env_vars": dict(WORKER_ENV, PYTHONPATH=_src(), VLLM_ENABLE_V1_MULTIPROCESSING="1")}
    for name, s, opts in [x for x in (("sync", spec, {}), ("sync-mp", spec, {"runtime_env": mp_env}),
                                      ("async", spec_async, {})) if x[0] in want]:
        t0 = time.perf_counter()
        actors[name] = R.options(num_cpus=0.5, **opts).remote(s, model_dir, 1)
        i = ray.get(actors[name].info.remote(), timeout=900)
        startup[name] = f"{i['startup_s']:.1f} s in the actor, {time.perf_counter() - t0:.1f} s until the actor answers"
        rss[name] = i["rss_mb"], i["processes"]
    refs = {"base": ray.put(base), "rand": ray.put(rand)}

    def bare_refit(name: str, state: dict) -> None:
        llm = bare[name]
        if name == "bare":
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items()),
                                                         "is_checkpoint_format": True})
        else:  # the engine core is a child process: tensors cross as bytes (what sync-mp and async do)
            llm.collective_rpc("grpo_reload_weights_from_bytes", args=(_to_bytes(state),))
        llm.reset_prefix_cache()

    def set_weights(which: str) -> None:
        for name in bare:
            bare_refit(name, base if which == "base" else rand)
        ray.get([x.update_weights.remote(refs[which]) for x in actors.values()])

    def bare_gen(llm):
        def run(seed: int):
            params = sampling_params(spec, a.n, seed, len(prompts), stop_ids)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            return [list(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
        return run

    def ours(actor):
        return lambda seed: [g.response_ids for g in ray.get(actor.generate.remote(prompts, a.n, seed))]

    engines = {name: bare_gen(bare[name]) if name in bare else ours(actors[name]) for name in PAIRS if name in want}
    results: dict[tuple[str, str], list[float]] = {}
    identical = {}
    for workload, which in (("toy", "base"), ("long", "rand")):
        set_weights(which)
        for gen in engines.values():
            gen(999)  # warm-up: the first eager call of a shape is slow
        outs = {name: gen(7) for name, gen in engines.items()}
        identical[workload] = {name: outs[name] == outs[PAIRS[name]] for name in engines}
        names = list(engines)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
                t0 = time.perf_counter()
                toks = sum(map(len, engines[name](r)))
                results.setdefault((workload, name), []).append(toks / (time.perf_counter() - t0))
                if a.verbose:
                    print(f"{workload} round {r} {name}: {toks} tokens, {results[(workload, name)][-1]:,.0f} tok/s",
                          flush=True)

    # ---------------------------------------------------------------- refit
    refit = {}
    for name in bare:
        ms = []
        for _ in range(a.refits):
            t0 = time.perf_counter()
            bare_refit(name, base)
            ms.append((time.perf_counter() - t0) * 1e3)
        refit[name] = (statistics.median(ms), None)
    for name, actor in actors.items():
        inside, outside = [], []
        for _ in range(a.refits):
            t0 = time.perf_counter()
            inside.append(ray.get(actor.update_weights.remote(refs["base"])))
            outside.append((time.perf_counter() - t0) * 1e3)
        refit[name] = (statistics.median(inside), statistics.median(outside))

    # ---------------------------------------------------------------- report
    print(f"\n`import vllm` {import_s:.1f} s in this process; load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| engine | start-up | RSS, process tree | processes |")
    print("|---|---|---|---|")
    for name in engines:
        print(f"| {name} | {startup[name]} | {rss[name][0]:.0f} MiB{' (delta of LLM())' if name in bare else ''} "
              f"| {rss[name][1]} |")
    print("\n| workload | engine | tokens/s, median | min–max | ratio vs | ratio | same tokens as it |")
    print("|---|---|---|---|---|---|---|")
    for workload in ("toy", "long"):
        for name in engines:
            xs = results[(workload, name)]
            m, ref = statistics.median(xs), statistics.median(results[(workload, PAIRS[name])])
            print(f"| {workload} | {name} | {m:,.0f} | {min(xs):,.0f}–{max(xs):,.0f} | {PAIRS[name]} | {m / ref:.2f} "
                  f"| {identical[workload][name]} |")
    print("\n| refit (full state dict, 27 tensors, 1.6 MB) | median ms in the engine | median ms, driver's ray.get |")
    print("|---|---|---|")
    for name, (inside, outside) in refit.items():
        print(f"| {name} | {inside:.1f} | {'—' if outside is None else f'{outside:.1f}'} |")

    ray.get([x.shutdown.remote() for x in actors.values()], timeout=300)
    for x in actors.values():
        ray.kill(x)
    ray.shutdown()
    for llm in bare.values():
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":  # vLLM spawns processes (engine cores): keep the guard
    main()
