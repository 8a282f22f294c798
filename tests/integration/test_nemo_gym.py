"""env=nemo_gym: Gym results → samples (masks, contiguity), Gym's lifecycle, pre-flight, and real runs.

Fast tier: the mapping of real-shaped `/run` results, the rollout client against a real local HTTP server, the
pre-flight rule, the recipe's Gym path dry-running through launch.py.
Slow tier (needs `make gym`; skipped, saying so, when it has not been run): the probe (token alignment against
the policy, a killed Gym server named within seconds, nothing left running), Gym's start-up timeout naming the
model endpoint that never answered, and a real short training run through launch.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from helpers import ROOT, share_models
from unit.test_nemo_gym import CONFIGS, GYM, needs_gym


# ---------------------------------------------------------------- real Gym (make gym)


def run_group(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """Run cmd in its own process group; past the timeout, SIGTERM the group (the command's own clean-up stops
    Gym and the engine), then SIGKILL whatever is left, and fail with the output so far."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            **kw)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:4])} ... ran past {timeout:.0f} s; output:\n{out[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@pytest.mark.slow
@pytest.mark.extended
@needs_gym
def test_probe_token_alignment_and_dead_server(tmp_path):
    """Real engine + real Gym: ids as the engine produced them, logprobs = the policy's, a killed server named."""
    out = tmp_path / "probe.json"
    env = dict(os.environ, GYM_PROBE_OUTPUT_ROOT=str(tmp_path))
    proc = run_group([sys.executable, "-m", "grpo_launcher.train.gym_probe", str(out), "--kill-server"], 2400, cwd=ROOT,
                     env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    r = json.loads(out.read_text())
    assert r["failed"] == 0 and r["rollouts"] == 36
    assert r["prompt_ids_equal_chat_template"] == r["rollouts"]
    # the prefix-token route (gym/serving.py): a history that does not survive detokenise + re-tokenise keeps the
    # engine's tokens as the next turn's prompt prefix; every multi-turn rollout is contiguous
    assert r["prefix_route_check"]["kept"], r["prefix_route_check"]
    assert r["non_contiguous"] == 0, r["non_contiguous_breaks"]
    # engine vs policy logprobs on every policy token of every sample: ~2e-6 (fp32, T = 1). The 0.04-0.14 outlier
    # once seen here was the first token of turn 2 in a NON-contiguous sample (stock re-tokenised history: the
    # rebuilt sequence is not the context the engine saw), which training masks; the route removed the cause.
    print("worst engine-vs-policy logprob:", r["worst_logprob"])
    assert r["policy_tokens"] > 0 and r["max_abs_logprob_diff"] < 1e-4, r["outliers"]
    assert set(r["agent_refs"]) == {"math_with_judge_simple_agent", "example_single_tool_call_simple_agent"}
    assert r["dead_server_error"].startswith("GymServerDied") and "math_with_judge" in r["dead_server_error"]
    assert r["dead_server_fail_s"] < 30
    assert r["left_running"] == []


@pytest.mark.slow
@pytest.mark.extended
@needs_gym
def test_gym_start_timeout_names_the_endpoint_that_never_answered(tmp_path):
    from grpo_launcher.gym.servers import GymError, GymServers, free_port

    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(GymError) as exc:
        GymServers.start(CONFIGS[:2], [dead], "tiny", tmp_path / "gym", timeout_s=90)
    assert f"policy model endpoint {dead}" in str(exc.value), str(exc.value)[:2000]
    assert time.monotonic() - t0 < 200
    assert not (tmp_path / "gym" / "gym.pid").exists()  # stopped by PID on the way out


@pytest.mark.slow
@needs_gym
def test_launch_trains_through_gym(tmp_path):
    """python launch.py env=nemo_gym rollout=vllm rollout.async_engine=true rollout.expose_http_server=true ..."""
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), *GYM, "grpo.max_steps=2", "grpo.num_prompts_per_step=4",
           "grpo.num_generations_per_prompt=4", "train.global_batch_size=16", "train.micro_batch_size=16",
           "train.logprob_batch_size=16", "grpo.val_period=2", "logging.train_data_log=true", "logging.progress=false",
           f"output_root={share_models(tmp_path)}", "name=h14-gym-train"]
    proc = run_group(cmd, 2400, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    assert "NeMo Gym ready" in out and "NeMo Gym stopped" in out
    lines = [json.loads(x) for x in next(tmp_path.rglob("train_data_step_000002.jsonl")).read_text().splitlines()]
    assert len(lines) == 16
    agents = {x["agent_ref"] for x in lines}
    assert agents <= {"math_with_judge_simple_agent", "example_single_tool_call_simple_agent"}
    for x in lines:
        assert len(x["token_ids"]) == len(x["token_loss_mask"]) == len(x["generation_logprobs"])
        assert sum(x["token_loss_mask"]) > 0 and x["token_loss_mask"][0] == 0
    metrics = [json.loads(x) for x in next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()]
    last = [m for m in metrics if m["step"] == 2][-1]
    assert last["gym/failed_rollouts"] == 0 and "val/reward_mean" in last
    assert not list(tmp_path.rglob("gym.pid")), "Gym was stopped by PID at the end of the run"
