"""Real-component checks of the Gym path, outside the loop (tests/integration/test_nemo_gym.py runs this; so can you):

    .venv/bin/python -m grpo_launcher.train.gym_probe OUT.json [--kill-server]

One VLLMRolloutWorker (async + HTTP, the tiny model refit from its HF weights) and `gym env start` with
math_with_judge + example_single_tool_call over it. Rows → Gym `/run`; then, per sample:
* prompt ids == the HF tokenizer's chat-template tokenisation of the row's messages (what vLLM rendered);
* the response ids Gym returned are scored by the HF model: |engine logprob − policy logprob| on every
  policy token (T = 1, so processed logprobs = raw log-softmax);
With --kill-server: SIGKILL one Gym server and time how long the next rollout batch takes to fail, and how.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import requests

from ..plan import make_plan
from ..spec.compose import load_spec
from ..spec.schema import RunSpec
from ..gym import register_env
from ..gym.servers import GymError, GymServers, _pid_alive
from ..gym.serving import CHATML
from ..models.attention import hf_attention
from .setup import prepare_model

if TYPE_CHECKING:  # the probe's module stays light (its heavy imports are in the functions that need them)
    from ..gym.env import GymEnv
    from ..gym.samples import GymGeneration
    from ..rollout.vllm import VLLMRolloutWorker

CONFIGS = ["responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
           "resources_servers/math_with_judge/configs/math_with_judge.yaml",
           "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"]


def tiny_spec(output_root: Path, new_tokens: int = 32, extra: tuple[str, ...] = ()) -> RunSpec:
    from ..gym.env import DATA  # here: heavy (see TYPE_CHECKING above)

    return load_spec(["env=nemo_gym", "rollout=vllm", "rollout.async_engine=true", "rollout.expose_http_server=true",
                      f"env.train_path={DATA / 'tiny_train.jsonl'}", f"env.val_path={DATA / 'tiny_val.jsonl'}",
                      f"env.gym_config_paths=[{','.join(CONFIGS)}]", "env.gym_tool_call_parser=pythonic",
                      "env.max_prompt_tokens=256", f"rollout.max_new_tokens={new_tokens}",
                      "train.max_total_sequence_length=512", f"output_root={output_root}", "name=h14-gym-probe",
                      "dry_run=true", *extra])


def tiny_engine(spec: RunSpec) -> tuple[Path, VLLMRolloutWorker, GymEnv]:
    """(model_dir, worker, env): the tiny model (built once, cached under output_root/.models) served over HTTP."""
    from ..gym.env import GymEnv  # here: heavy (see TYPE_CHECKING above)
    from ..rollout.vllm import VLLMRolloutWorker

    register_env()
    env = GymEnv(spec.env, seed=0)
    plan = make_plan(spec)
    model_dir = prepare_model(spec, plan, env)
    worker = VLLMRolloutWorker(spec, str(model_dir), max_model_len=plan.max_model_len)
    try:
        from transformers import AutoModelForCausalLM  # here: heavy (see TYPE_CHECKING above)

        hf = AutoModelForCausalLM.from_pretrained(model_dir)
        worker.update_weights({k: v.detach() for k, v in hf.state_dict().items()})
    except BaseException:
        worker.shutdown()
        raise
    return model_dir, worker, env


def policy_logprobs(model_dir: Path, gens: Sequence[GymGeneration]) -> list[list[float]]:
    """log p(token) under the HF model, for every response token of every sample (T = 1)."""
    import torch  # here: heavy (see TYPE_CHECKING above)
    from transformers import AutoModelForCausalLM

    # the policy's attention (eager where sdpa drops Gemma-2's softcapping: models/attention.py)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **hf_attention(str(model_dir))).eval()
    out = []
    with torch.no_grad():
        for g in gens:
            seq = torch.tensor([g.prompt_ids + g.response_ids])
            logits = model(seq).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            P = len(g.prompt_ids)
            out.append([float(lp[P - 1 + j, t]) for j, t in enumerate(g.response_ids)])
    return out


def main(argv: list[str]) -> int:
    from transformers import AutoTokenizer  # here: heavy (see TYPE_CHECKING above)

    from ..gym.rollouts import RolloutStats, run_rollouts, stamp_row

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped probe still stops Gym and the engine
    out_path = Path(argv[0])
    kill = "--kill-server" in argv
    root = Path(os.environ.get("GYM_PROBE_OUTPUT_ROOT", Path.cwd() / "outputs"))
    spec = tiny_spec(root)
    report: dict = {}
    t0 = time.perf_counter()
    model_dir, worker, env = tiny_engine(spec)
    report["engine_start_s"] = round(time.perf_counter() - t0, 1)
    servers = None
    try:
        url = worker.http_url()
        assert url is not None, "tiny_spec exposes the engine's HTTP server (rollout.expose_http_server=true)"
        t1 = time.perf_counter()
        servers = GymServers.start(CONFIGS, [url], spec.model.name,
                                   Path(tempfile.mkdtemp(prefix="h14-gym-probe-")) / "gym")
        report["gym_start_s"] = round(time.perf_counter() - t1, 1)
        agents = servers.agents()
        report["agents"] = sorted(agents)
        report["servers"] = [f"{i.get('process_name')} ({i.get('server_type')}) pid {i.get('pid')}"
                             for i in servers.instances]
        prompts = env.train
        rows = [stamp_row(p.row, 1.0, 1.0, spec.rollout.max_new_tokens) for p in prompts for _ in range(2)]
        stats = RolloutStats()
        gens = run_rollouts(rows, agents, servers.check, stats=stats, max_model_len=make_plan(spec).max_model_len)
        tok = AutoTokenizer.from_pretrained(model_dir)
        stop = worker.stop_ids  # the checkpoint's stop set (stop_tokens.py), as the engine stops at it
        template = CHATML.read_text()
        expect = [tok(tok.apply_chat_template(r["responses_create_params"]["input"], chat_template=template,
                                              add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"] for r in rows]
        ok = [g for g in gens if not g.failed]
        lps = policy_logprobs(model_dir, ok)
        # per policy token: |engine - policy|, on the samples the trainer uses (contiguous) and, apart, on the
        # non-contiguous ones (masked in training: their rebuilt sequence is not what the engine saw)
        tokens = [token_row(g, i, j, a, b) for i, (g, ref) in enumerate(zip(ok, lps))
                  for j, (a, b, m) in enumerate(zip(g.logprobs, ref, g.loss_mask)) if m]
        diffs = [t["diff"] for t in tokens if t["contiguous"]]
        report["worst_logprob"] = max((t for t in tokens if t["contiguous"]), key=lambda t: t["diff"], default=None)
        report["logprob_diff_over_1e-4"] = sum(d > 1e-4 for d in diffs)
        report["outliers"] = [t for t in tokens if t["diff"] > 1e-4][:40]
        report["non_contiguous_tokens_over_1e-4"] = sum(t["diff"] > 1e-4 for t in tokens if not t["contiguous"])
        report["prefix_route"] = os.environ.get("GRPO_GYM_PREFIX_ROUTE", "1") != "0"
        report.update({
            "rollouts": len(gens), "failed": stats.failed, "errors": stats.errors[:5],
            "non_contiguous": stats.non_contiguous, "turns": sorted({g.turns for g in gens}),
            "prompt_ids_equal_chat_template": sum(g.prompt_ids == e for g, e in zip(gens, expect)),
            "policy_tokens": len(diffs), "max_abs_logprob_diff": max(diffs) if diffs else None,
            "rewards": sorted({g.reward for g in gens}), "reward_mean": sum(g.reward for g in gens) / len(gens),
            "multi_turn": sum(g.turns > 1 for g in gens), "truncated": sum(g.truncated for g in gens),
            "masked_tokens_in_multi_turn": sum(g.loss_mask.count(0) for g in gens if g.turns > 1),
            "example_multi_turn": next((tok.decode(g.prompt_ids + g.response_ids) for g in gens if g.turns > 1), None),
            "agent_refs": sorted({g.agent_ref for g in gens}),
            "eos_terminated": sum(ends_at_stop(g.response_ids, stop) for g in ok)})
        report["non_contiguous_breaks"] = [
            {"sample": i, "turns": g.turns, "at": g.break_at,
             "engine_tokens": tok.decode((g.prompt_ids + g.response_ids)[max(0, g.break_at - 8): g.break_at + 4]),
             "turn_1_ended_with_eos": ends_at_stop(first_turn(g), stop)}
            for i, g in enumerate(ok) if not g.contiguous][:10]
        report["prefix_route_check"] = prefix_route_check(url, spec.model.name, tok, template)
        if kill:
            victim = next(i for i in servers.instances if i.get("server_type") == "resources_servers")
            os.kill(int(victim["pid"]), signal.SIGKILL)
            t2 = time.perf_counter()
            try:
                run_rollouts(rows, agents, servers.check)
                report["dead_server_error"] = None
            except GymError as exc:
                report["dead_server_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            report["dead_server_fail_s"] = round(time.perf_counter() - t2, 2)
            report["killed"] = victim.get("process_name")
    finally:
        t3 = time.perf_counter()
        if servers is not None:
            servers.stop()
            report["gym_stop_s"] = round(time.perf_counter() - t3, 1)
            report["left_running"] = _left(servers)
        worker.shutdown()
    out_path.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


def prefix_route_check(base_url: str, model: str, tok: Any, template: str) -> dict:
    """The engine's own /tokenize (chat form, what Gym reads a turn's prompt ids from) on a 2-turn history whose
    assistant turn does not survive detokenise + re-tokenise (it ends in a lone byte 0xff, invalid UTF-8: the text
    Gym sends back holds U+FFFD, three other bytes): with the prefix-token route the next prompt starts with
    exactly the engine's tokens; stock vLLM re-tokenises the text (what the reference doc measured: 0 of 6 kept)."""
    user = [{"role": "user", "content": "weather in oslo?"}]
    prompt = tok(tok.apply_chat_template(user, chat_template=template, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    lone = tok.convert_tokens_to_ids("\u00ff")  # byte-level BPE's symbol for the byte 0xff
    gen = tok("sunny", add_special_tokens=False)["input_ids"] + [lone, tok.eos_token_id]
    text = tok.decode(gen[:-1])
    canonical = tok(text, add_special_tokens=False)["input_ids"]
    messages = [*user, {"role": "assistant", "content": text, "prompt_token_ids": prompt, "generation_token_ids": gen,
                        "generation_log_probs": [0.0] * len(gen)}, {"role": "user", "content": "and tomorrow?"}]
    r = requests.post(base_url.rsplit("/v1", 1)[0] + "/tokenize",
                      json={"model": model, "messages": messages, "add_generation_prompt": True}, timeout=60)
    r.raise_for_status()
    ids = r.json()["tokens"]
    return {"kept": ids[: len(prompt) + len(gen)] == prompt + gen, "generated_as": len(gen) - 1,
            "canonical_tokens": len(canonical), "prompt_tokens": len(ids)}


def ends_at_stop(ids: list[int], stop_ids: Collection[int]) -> bool:
    """Whether a run of generated tokens ends with a stop token (any of the checkpoint's stop set, not only the
    tokenizer's EOS): the engine stopped there rather than at max tokens."""
    return bool(ids) and ids[-1] in stop_ids


def first_turn(g: GymGeneration) -> list[int]:
    """A sample's first-turn response tokens: up to its first non-policy (loss-masked) token."""
    mask = list(g.loss_mask)
    return list(g.response_ids[: mask.index(0)] if 0 in mask else g.response_ids)


def token_row(g: GymGeneration, sample: int, j: int, engine: float, policy: float) -> dict:
    """One policy token of a sample: where it is (turn k of the rollout, position within that turn)."""
    turn, pos, prev = 0, 0, 0
    for m in g.loss_mask[: j + 1]:
        if m and not prev:
            turn, pos = turn + 1, 0
        elif m:
            pos += 1
        prev = m
    return {"diff": abs(engine - policy), "engine": engine, "policy": policy, "sample": sample, "turns": g.turns,
            "turn": turn, "position_in_turn": pos, "position": len(g.prompt_ids) + j, "token": g.response_ids[j],
            "contiguous": g.contiguous, "agent_ref": g.agent_ref}


def _left(servers: GymServers) -> list[int]:
    pids = [servers.proc.pid, *(int(i["pid"]) for i in servers.instances if i.get("pid"))]
    return [p for p in pids if _pid_alive(p)]


if __name__ == "__main__":  # the engine's processes re-import this module
    sys.exit(main(sys.argv[1:]))
