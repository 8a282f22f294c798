"""env=nemo_gym: Gym results → samples (masks, contiguity), Gym's lifecycle, pre-flight, and real runs.

Fast tier: the mapping of real-shaped `/run` results, the rollout client against a real local HTTP server, the
pre-flight rule, the recipe's Gym path dry-running through launch.py.
Slow tier (needs `make gym`; skipped, saying so, when it has not been run): the probe (token alignment against
the policy, a killed Gym server named within seconds, nothing left running), Gym's start-up timeout naming the
model endpoint that never answered, and a real short training run through launch.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from grpo_launcher.gym.env import DATA, GymEnv
from grpo_launcher.gym.install import find_install
from grpo_launcher.gym import preflight as gym_preflight
from grpo_launcher.gym.rollouts import RolloutStats, run_rollouts, stamp_row
from grpo_launcher.gym.samples import failed_generation, to_generation
from grpo_launcher.gym.servers import GymServerDied, gym_config
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.errors import ConfigError

from helpers import ROOT

CONFIGS = ["responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
           "resources_servers/math_with_judge/configs/math_with_judge.yaml",
           "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"]
GYM = ["env=nemo_gym", "rollout=vllm", "rollout.async_engine=true", "rollout.expose_http_server=true",
       f"env.train_path={DATA / 'tiny_train.jsonl'}", f"env.val_path={DATA / 'tiny_val.jsonl'}",
       f"env.gym_config_paths=[{','.join(CONFIGS)}]", "env.gym_tool_call_parser=pythonic",
       "env.max_prompt_tokens=256", "train.max_total_sequence_length=512", "rollout.max_new_tokens=32"]


def gym_check(spec):
    """The Gym pre-flight of a real launch: its spec checks, then its probes (gym/rules.py)."""
    return [*gym_preflight.check(spec), *gym_preflight.probe(spec)]


def needs_gym(test):
    """A test of real Gym: marked `gym` (make test runs it after Gym's build) and skipped where Gym is missing."""
    skip = pytest.mark.skipif(find_install() is None, reason="NeMo Gym's venv is not installed: run `make gym`")
    return pytest.mark.gym(skip(test))

MATH_ROW = {"responses_create_params": {"input": [{"role": "user", "content": "What is 2+2?"}],
                                        "max_output_tokens": 64},
            "expected_answer": "4", "agent_ref": {"type": "responses_api_agents", "name": "math_agent"}}


def item(prompt, gen, lps=None, kind="message"):
    return {"type": kind, "prompt_token_ids": prompt, "generation_token_ids": gen,
            "generation_log_probs": lps if lps is not None else [-0.5] * len(gen)}


# ---------------------------------------------------------------- results → samples


def test_single_turn_sample_keeps_the_engines_ids():
    res = {"reward": 1.0, "response": {"status": "completed", "output": [item([5, 6, 7], [8, 9, 2], [-1, -2, -3])]}}
    g = to_generation(res, MATH_ROW)
    assert (g.prompt_ids, g.response_ids, g.logprobs) == ([5, 6, 7], [8, 9, 2], [-1.0, -2.0, -3.0])
    assert g.loss_mask == (1, 1, 1) and g.turns == 1 and g.contiguous and g.trainable
    assert (g.reward, g.agent_ref, g.truncated) == (1.0, "math_agent", False)


def test_truncation_from_incomplete_details_and_from_max_model_len():
    res = {"reward": 0.0, "response": {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
                                       "output": [item([1, 2], [3, 4])]}}
    assert to_generation(res, MATH_ROW).truncated
    done = {"reward": 0.0, "response": {"status": "completed", "output": [item([1, 2], [3, 4])]}}
    assert not to_generation(done, MATH_ROW).truncated
    assert to_generation(done, MATH_ROW, max_model_len=4).truncated  # the context is full


def test_multi_turn_mask_covers_only_policy_tokens():
    """call 1: prompt P, generates a tool call; Gym appends the tool output T; call 2 continues."""
    P, g1, tool, g2 = [10, 11, 12], [20, 21], [30, 31, 32, 33], [40, 41, 2]
    res = {"reward": 1.0, "response": {"status": "completed", "output": [
        item(P, g1, [-0.1, -0.2], kind="function_call"),
        {"type": "function_call_output", "output": "cold"},  # no ids: not a model call
        item(P + g1 + tool, g2, [-0.3, -0.4, -0.5])]}}
    g = to_generation(res, MATH_ROW)
    assert g.prompt_ids == P
    assert g.response_ids == g1 + tool + g2
    assert g.loss_mask == (1, 1, 0, 0, 0, 0, 1, 1, 1)
    assert g.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, 0.0, -0.3, -0.4, -0.5]
    assert g.turns == 2 and g.contiguous and g.trainable


def test_items_of_one_call_count_once():
    """A call that produced text + a function call attaches the same ids to both items."""
    res = {"reward": 0.0, "response": {"output": [item([1], [2, 3]), item([1], [2, 3], kind="function_call")]}}
    g = to_generation(res, MATH_ROW)
    assert g.response_ids == [2, 3] and g.turns == 1


def test_non_contiguous_turns_are_flagged_and_not_trainable():
    """Turn 2's prompt does not start with turn 1's prompt + generation (vLLM re-tokenised the history)."""
    res = {"reward": 1.0, "response": {"output": [item([10, 11], [20, 21]), item([10, 11, 20, 99, 30], [40])]}}
    g = to_generation(res, MATH_ROW)
    assert not g.contiguous and not g.trainable
    assert len(g.response_ids) == len(g.loss_mask) == len(g.logprobs)


def test_unusable_results_become_failed_samples():
    assert to_generation({"reward": 1.0, "response": {"output": [{"type": "message"}]}}, MATH_ROW).failed
    bad = {"reward": 1.0, "response": {"output": [item([1], [2, 3], [-1.0])]}}  # 2 tokens, 1 logprob
    g = to_generation(bad, MATH_ROW)
    assert g.failed and not g.trainable and g.reward == 0.0
    assert failed_generation(MATH_ROW, "x").loss_mask == (0,)


def test_gym_mask_sample_is_not_trainable():
    res = {"reward": 0.0, "mask_sample": True, "response": {"output": [item([1], [2])]}}
    assert not to_generation(res, MATH_ROW).trainable


def test_make_batch_applies_the_gym_masks():
    from grpo_launcher.train.gym_loop import GymSource
    from grpo_launcher.plan import make_plan

    spec = load_spec([*GYM, "grpo.num_prompts_per_step=1", "grpo.num_generations_per_prompt=2",
                      "train.global_batch_size=2", "train.micro_batch_size=2", "train.logprob_batch_size=2",
                      "dry_run=true"])
    t = object.__new__(GymSource)  # make_batch needs only the spec, the plan (group size) and the pad id
    t.spec, t.plan = spec, make_plan(spec)
    t.tok = type("Tok", (), {"pad_token_id": 0})()
    multi = to_generation({"reward": 1.0, "response": {"output": [item([1, 2], [3]), item([1, 2, 3, 7, 7], [4])]}},
                          MATH_ROW)
    broken = to_generation({"reward": 0.0, "response": {"output": [item([1, 2], [3]), item([9, 9], [4])]}}, MATH_ROW)
    batch, m = t.make_batch([multi, broken], torch.tensor([1.0, 0.0]))
    assert batch.response_mask[0, :4].tolist() == [1, 0, 0, 1]
    assert batch.sample_mask.tolist() == [1.0, 0.0]
    assert m["gym/non_contiguous_samples"] == 1 and m["gym/multi_turn_samples"] == 2


def test_a_failed_or_env_masked_rollout_is_left_out_of_its_groups_baseline():
    """[1, 1, 1, failed]: the three valid samples did equally well, so their advantage is 0; at 27486e1 the failed
    rollout's placeholder 0 sat in the group's mean and std and gave each +0.5. The same for Gym's mask_sample (the
    environment failed, not the policy); a non-contiguous sample's reward is the policy's own and still counts."""
    from grpo_launcher.algos import compute_advantages
    from grpo_launcher.gym.samples import failed_generation
    from grpo_launcher.plan import make_plan
    from grpo_launcher.train.gym_loop import GymSource

    spec = load_spec([*GYM, "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
                      "train.global_batch_size=8", "train.micro_batch_size=2", "train.logprob_batch_size=2",
                      "dry_run=true"])
    t = object.__new__(GymSource)
    t.spec, t.plan = spec, make_plan(spec)
    t.tok = type("Tok", (), {"pad_token_id": 0})()
    ok = lambda r: to_generation({"reward": r, "response": {"output": [item([1, 2], [3])]}}, MATH_ROW)  # noqa: E731
    env_masked = to_generation({"reward": 0.0, "mask_sample": True, "response": {"output": [item([1, 2], [3])]}},
                               MATH_ROW)
    gens = [ok(1.0), ok(1.0), ok(1.0), failed_generation(MATH_ROW, "agent error"),
            ok(1.0), ok(0.0), env_masked, ok(0.0)]
    rewards = torch.tensor([g.reward for g in gens])
    batch, _ = t.make_batch(gens, rewards)
    assert batch.advantages[:4].tolist() == [0.0] * 4
    expect = compute_advantages(spec.loss.advantage, torch.tensor([1.0, 0.0, 0.0]), 3)
    assert torch.allclose(batch.advantages[[4, 5, 7]], expect) and batch.advantages[6] == 0
    assert batch.sample_mask.tolist() == [1, 1, 1, 0, 1, 1, 0, 1]


# ---------------------------------------------------------------- the prefix-token route (gym/serving.py)


def test_splice_keeps_the_engines_tokens_then_the_templates_continuation():
    """NeMo-RL's example: turn 1 generated [220, 17, EOS]; the template re-tokenises that text as [1001]."""
    from grpo_launcher.gym.serving import splice_prefix

    eos = 2
    model = [11, 12, 13, 40, 41, 220, 17, eos]  # turn 1's prompt + generation, as the engine produced them
    template_prefix = [11, 12, 13, 40, 41, 1001, eos, 7, 40, 41]  # history to the assistant msg (+ generation prompt)
    template = [11, 12, 13, 40, 41, 1001, eos, 7, 21, 22, eos, 7, 40, 41]  # + a tool turn + generation prompt
    out = splice_prefix(model, template_prefix, template, {eos})
    assert out == [11, 12, 13, 40, 41, 220, 17, eos, 7, 21, 22, eos, 7, 40, 41]
    assert out[: len(model)] == model  # contiguous: the next turn's prompt extends what the engine produced
    # a turn cut by max tokens (no EOS): the template's end-of-turn follows the engine's tokens
    assert splice_prefix([11, 220], [11, 1001, eos, 7], [11, 1001, eos, 7, 21, eos], {eos}) == \
        [11, 220, eos, 7, 21, eos]
    # a tool turn shorter than the generation prompt: its EOS is not mistaken for the assistant's
    assert splice_prefix([11, 5, eos], [11, 5, eos, 7, 40, 41, 42], [11, 5, eos, 7, 9, eos, 7, 40, 41, 42],
                         {eos}) == [11, 5, eos, 7, 9, eos, 7, 40, 41, 42]
    with pytest.raises(ValueError, match="end-of-turn"):
        splice_prefix([1, 2], [5, 6], [5, 6, 7], {eos})


def test_splice_ends_a_turn_at_any_stop_token_not_only_the_tokenizers_eos():
    """A Qwen3-style checkpoint: tokenizer EOS <|endoftext|> (2), chat turns end with <|im_end|> (3), listed in
    generation_config.json's eos_token_id. The engine stops at 3; the splice must cut there and find the template's
    3, which the tokenizer's EOS alone never matches."""
    from grpo_launcher.gym.serving import splice_prefix

    eos, im_end = 2, 3
    model = [11, 40, 220, 17, im_end]
    template_prefix = [11, 40, 1001, im_end, 7, 40]
    template = [11, 40, 1001, im_end, 7, 21, im_end, 7, 40]
    assert splice_prefix(model, template_prefix, template, (eos, im_end)) == [11, 40, 220, 17, im_end, 7, 21, im_end,
                                                                              7, 40]
    with pytest.raises(ValueError, match="end-of-turn"):  # what the tokenizer's EOS alone made of it
        splice_prefix(model, template_prefix, template, (eos,))


def test_probe_counts_a_turn_ended_by_any_stop_token():
    """train/gym_probe.py's EOS-terminated counts: a response (and a multi-turn sample's first turn) ending with a
    generation-config stop id counts; one cut by max tokens does not."""
    from grpo_launcher.train.gym_probe import ends_at_stop, first_turn

    eos, im_end, stop = 2, 3, (2, 3)
    multi = to_generation({"reward": 1.0, "response": {"output": [item([1, 5], [8, im_end]),
                                                                  item([1, 5, 8, im_end, 7, 7], [9, im_end])]}},
                          MATH_ROW)
    assert multi.loss_mask == (1, 1, 0, 0, 1, 1) and multi.contiguous
    assert first_turn(multi) == [8, im_end] and ends_at_stop(first_turn(multi), stop)
    assert ends_at_stop(multi.response_ids, stop) and not ends_at_stop(multi.response_ids, (eos,))
    cut = to_generation({"reward": 0.0, "response": {"output": [item([1, 5], [8, 9])]}}, MATH_ROW)
    assert first_turn(cut) == [8, 9] and not ends_at_stop(cut.response_ids, stop)
    assert not ends_at_stop([], stop)


def test_required_prefix_from_the_body_or_gyms_last_assistant_message():
    from grpo_launcher.gym.serving import required_prefix

    class Req:
        model_extra = {}

    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "a", "prompt_token_ids": [1, 2], "generation_token_ids": [3, 2]},
            {"role": "tool", "content": "cold"},
            {"role": "assistant", "content": "b", "prompt_token_ids": [1, 2, 3, 2, 9], "generation_token_ids": [4]},
            {"role": "user", "content": "and?"}]
    assert required_prefix(Req(), msgs) == [1, 2, 3, 2, 9, 4]
    assert required_prefix(Req(), msgs[:1]) is None
    body = Req()
    body.model_extra = {"required_prefix_token_ids": [7, 8]}
    assert required_prefix(body, msgs) == [7, 8]


def test_preflight_multi_node_engines_must_not_serve_on_loopback():
    spec = load_spec([*GYM, "cluster=local_slurm", "dry_run=true"])  # 2 nodes
    found = list(gym_check(dataclasses.replace(spec, dry_run=False)))
    assert any(k == ("rollout.http_host", "cluster.nodes") for k, _, _ in found), found
    wide = dataclasses.replace(spec, dry_run=False, rollout=dataclasses.replace(spec.rollout, http_host="0.0.0.0"))
    assert not any("rollout.http_host" in k for k, _, _ in gym_check(wide))


def test_nemo_gym_is_in_the_env_registry():
    from grpo_launcher.envs import LAZY_ENVS, env_class
    from grpo_launcher.train.gym_loop import GymSource

    assert "nemo_gym" in LAZY_ENVS
    cls = env_class("nemo_gym")
    assert cls is GymEnv and cls.rollout_source() is GymSource


# ---------------------------------------------------------------- rows, config, env


def test_stamp_row_sets_sampling_and_clamps_the_output_budget():
    row = stamp_row(MATH_ROW, 0.7, 1.0, 16)
    p = row["responses_create_params"]
    assert (p["temperature"], p["top_p"], p["max_output_tokens"]) == (0.7, 1.0, 16)
    assert MATH_ROW["responses_create_params"]["max_output_tokens"] == 64  # the row itself is untouched
    assert stamp_row({"responses_create_params": {}}, 1.0, 1.0, 8)["responses_create_params"]["max_output_tokens"] == 8


def test_gym_config_points_the_policy_model_at_our_engines(tmp_path):
    cfg = gym_config(CONFIGS, ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"], "tiny", None, "127.0.0.1", 5555,
                     tmp_path, ["math_with_judge.resources_servers.math_with_judge.should_use_judge=false"])
    assert cfg["policy_base_url"] == ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]
    assert cfg["head_server"] == {"host": "127.0.0.1", "port": 5555} and cfg["default_host"] == "127.0.0.1"
    assert cfg["skip_venv_if_present"] is True and cfg["uv_venv_dir"] == str(tmp_path)
    assert cfg["math_with_judge"]["resources_servers"]["math_with_judge"]["should_use_judge"] is False
    assert cfg["policy_api_key"] == "dummy_key"


def test_env_draws_rows_deterministically():
    spec = load_spec([*GYM, "dry_run=true"])
    env = GymEnv(spec.env, seed=0)
    a, b = env.train_prompts(3, 0, 5), env.train_prompts(3, 0, 5)
    assert [p.index for p in a] == [p.index for p in b]
    assert {p.agent_ref for p in env.train} == {"math_with_judge_simple_agent", "example_single_tool_call_simple_agent"}
    assert all(p.row["responses_create_params"]["input"] for p in a)


# ---------------------------------------------------------------- the rollout client, a real HTTP server


class _Agent:
    """A real HTTP server on loopback standing in for an agent's /run: answers, errors, or never answers."""

    def __init__(self, mode: str):
        from aiohttp import web

        self.mode = mode
        app = web.Application()
        app.router.add_post("/run", self.run)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def run(self, request):
        from aiohttp import web

        row = await request.json()
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "reject" and "2+2" in json.dumps(row):
            return web.Response(status=500, text="agent failed")
        n = row["responses_create_params"]["max_output_tokens"]
        return web.json_response({"reward": 1.0, "response": {"status": "completed",
                                                              "output": [item([1, 2], list(range(3, 3 + n)))]}})

    def close(self):
        try:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        except Exception:  # noqa: BLE001  (a handler still hanging: the loop stops regardless)
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def test_rollouts_run_concurrently_and_a_rejected_row_is_counted_not_dropped():
    agent = _Agent("reject")
    try:
        other = dict(MATH_ROW, responses_create_params={"input": "What is 3+3?"})
        rows = [stamp_row(r, 1.0, 1.0, 4) for r in (MATH_ROW, other, other)]
        stats = RolloutStats()
        gens = run_rollouts(rows, {"math_agent": f"http://127.0.0.1:{agent.port}"}, stats=stats)
        assert len(gens) == 3 and gens[0].failed and "HTTP 500" in gens[0].failed
        assert [g.response_ids for g in gens[1:]] == [[3, 4, 5, 6]] * 2
        assert (stats.rollouts, stats.failed) == (3, 1)
        unknown = run_rollouts([dict(MATH_ROW, agent_ref={"name": "nobody"})], {"math_agent": "http://x"})
        assert "no agent named 'nobody'" in unknown[0].failed
    finally:
        agent.close()


def test_a_dead_gym_server_fails_the_batch_fast_naming_it():
    agent = _Agent("hang")  # the agent never answers; the liveness check finds its server gone

    def check():
        raise GymServerDied("NeMo Gym server 'math_with_judge' (resources_servers/math_with_judge, pid 1) died")

    try:
        t0 = time.monotonic()
        with pytest.raises(GymServerDied, match="math_with_judge"):
            run_rollouts([stamp_row(MATH_ROW, 1.0, 1.0, 4)], {"math_agent": f"http://127.0.0.1:{agent.port}"}, check)
        assert time.monotonic() - t0 < 30
    finally:
        agent.close()


# ---------------------------------------------------------------- pre-flight


def test_recipe_gym_path_dry_runs():
    out = subprocess.run([sys.executable, str(ROOT / "launch.py"), "+recipe=nanov3", "cluster=slurm", "dry_run=true"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_tiny_gym_run_dry_runs(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "launch.py"), *GYM, f"output_root={tmp_path}", "dry_run=true"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def _problems(dry_run: bool = False, **env):
    """The Gym pre-flight's findings for the tiny setup with env fields replaced (no ConfigError raised)."""
    spec = load_spec([*GYM, "dry_run=true"])
    spec = dataclasses.replace(spec, dry_run=dry_run, env=dataclasses.replace(spec.env, **env))
    return list(gym_check(spec))


def test_preflight_names_bad_overrides_even_in_dry_runs():
    with pytest.raises(ConfigError) as exc:
        load_spec([*GYM, 'env.gym_overrides=["no_equals_sign"]', "dry_run=true"])
    (v,) = exc.value.violations
    assert v.rule == "gym_preflight" and v.keys == ("env.gym_overrides",) and "dotted.key=value" in v.message


def test_preflight_rows_without_agent_ref(tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text(json.dumps({"responses_create_params": {"input": "hi"}}) + "\n")
    found = _problems(train_path=str(bad))
    assert any(k == ("env.train_path",) and "no agent_ref" in m for k, m, _ in found), found


def test_preflight_tool_rows_need_a_parser():
    found = _problems(gym_tool_call_parser=None)
    assert any("env.gym_tool_call_parser" in k for k, _, _ in found), found


@needs_gym
def test_preflight_one_agent_per_agent_ref():
    found = _problems(gym_config_paths=CONFIGS[:2])
    assert any("example_single_tool_call_simple_agent" in m for _, m, _ in found), found
    assert not _problems(), "the shipped tiny setup is consistent"


@needs_gym
def test_recipe_environments_rows_and_servers_are_consistent():
    """Two more of the Nano v3 recipe's six (no internet, no API key): mcqa, workplace_assistant (multi-step tools);
    `make gym` installs their servers and the shipped tiny rows route to their agents."""
    recipe = [CONFIGS[0], "resources_servers/mcqa/configs/mcqa.yaml",
              "resources_servers/workplace_assistant/configs/workplace_assistant.yaml"]
    found = _problems(gym_config_paths=recipe, train_path=str(DATA / "tiny_recipe_train.jsonl"),
                      val_path=str(DATA / "tiny_recipe_val.jsonl"))
    assert not found, found


@needs_gym
def test_preflight_missing_config_file():
    found = _problems(gym_config_paths=[CONFIGS[0], "resources_servers/nope/configs/nope.yaml"])
    assert any("no Gym config resources_servers/nope" in m for _, m, _ in found), found


def test_nemo_gym_is_refused_without_gym_outside_dry_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("GYM_HOME", str(tmp_path / "no-gym"))
    with pytest.raises(ConfigError) as exc:
        load_spec(GYM)
    assert any(v.rule == "build_implements_run" and "env.name" in v.keys for v in exc.value.violations)
