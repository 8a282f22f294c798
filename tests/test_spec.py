"""Compose the real conf/ with Hydra: every option composes, every rule fires with its key named."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from grpo_launcher.plan import make_plan, parse_duration
from grpo_launcher.spec.compose import CONF_DIR, load_spec, spec_to_yaml
from grpo_launcher.spec.errors import ConfigError
from grpo_launcher.spec.rules import RULES
from grpo_launcher.spec.schema import RunSpec

SNAPSHOT = Path(__file__).parent / "snapshots" / "nanov3_slurm.yaml"
SLURM_OK = ["cluster=slurm", "dry_run=true"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def violations(overrides: list[str]) -> list:
    with pytest.raises(ConfigError) as info:
        load_spec(overrides)
    return info.value.violations


def test_default_composes_to_frozen_spec():
    spec = load_spec([])
    assert isinstance(spec, RunSpec)
    assert (spec.model.name, spec.rollout.backend.value, spec.loss.name, spec.cluster.kind.value) == (
        "tiny", "hf", "grpo", "local")
    with pytest.raises(AttributeError):
        spec.grpo.max_steps = 3  # frozen


@pytest.mark.parametrize("recipe", options("recipe"))
@pytest.mark.parametrize("cluster", options("cluster"))
def test_every_recipe_and_cluster_composes(recipe, cluster):
    overrides = [f"+recipe={recipe}", f"cluster={cluster}", "dry_run=true"]
    if cluster == "slurm":
        spec = load_spec(overrides)
        assert spec.cluster.nodes == 32 and spec.cluster.gpus_per_node == 8
    elif cluster == "local_slurm":  # the local pseudo-cluster's nodes have no GPUs: the rule says so
        assert {v.rule for v in violations(overrides)} == {"slurm_node_shape"}
    else:  # a 32-node recipe cannot run on one machine: composition works, the rule says why
        assert {v.rule for v in violations(overrides)} == {"local_is_one_node"}


@pytest.mark.parametrize("group", ["model", "rollout", "loss", "env"])
def test_every_group_option_validates(group):
    for option in options(group):
        extra = {"model": [], "rollout": [], "loss": [], "env": []}[group]
        if (group, option) == ("env", "nemo_gym"):
            extra = ["rollout=vllm", "rollout.async_engine=true", "rollout.expose_http_server=true",
                     "env.max_prompt_tokens=16"]
        if group == "model" and option != "tiny":
            extra = ["rollout.max_new_tokens=16"]
        spec = load_spec([f"{group}={option}", *extra, *SLURM_OK])
        section = getattr(spec, group)
        picked = section.backend.value if group == "rollout" else section.name
        assert str(getattr(picked, "value", picked)) == option


def test_nanov3_snapshot():
    text = spec_to_yaml(load_spec(["+recipe=nanov3", *SLURM_OK]))
    if os.environ.get("UPDATE_SNAPSHOTS") or not SNAPSHOT.exists():
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text(), "nanov3 defaults changed: rerun with UPDATE_SNAPSHOTS=1 and review the diff"


def test_nanov3_plan_and_seed_fixes():
    spec = load_spec(["+recipe=nanov3", *SLURM_OK])
    plan = make_plan(spec)
    assert (plan.world_size, plan.dp_size, plan.rollout_engines) == (256, 16, 64)
    assert spec.rollout.async_engine and spec.rollout.expose_http_server  # review bug 1, in the spec
    assert spec.grpo.max_val_samples is None  # review bug 2: null = all


# (overrides, rule, key that must be named). Every rule in RULES appears at least once.
FAILING = [
    (["grpo.max_steps=0"], "positive_sizes", "grpo.max_steps"),
    (["grpo.num_generations_per_prompt=1", "train.global_batch_size=8", "train.micro_batch_size=1",
      "train.logprob_batch_size=1"], "group_size_at_least_two", "grpo.num_generations_per_prompt"),
    (["cluster.nodes=3", "train.backend=megatron", "train.tensor_parallel_size=2"],
     "train_parallel_divides_world", "train.tensor_parallel_size"),
    (["rollout=vllm", "cluster.gpus_per_node=8", "rollout.tensor_parallel_size=3"],
     "rollout_parallel_divides_world", "rollout.tensor_parallel_size"),
    (["rollout=vllm", "cluster.cpu_workers_per_node=2", "rollout.tensor_parallel_size=4"],
     "rollout_tp_within_node", "rollout.tensor_parallel_size"),
    (["train.global_batch_size=12"], "rollout_batch_divisible_by_gbs", "train.global_batch_size"),
    (["cluster.nodes=3"], "gbs_divisible_by_dp", "train.global_batch_size"),
    (["train.micro_batch_size=3"], "gbs_divisible_by_dp", "train.micro_batch_size"),
    (["train.logprob_batch_size=5"], "logprob_batch_divides", "train.logprob_batch_size"),
    (["train.tensor_parallel_size=2", "cluster.cpu_workers_per_node=2"],
     "torch_backend_is_data_parallel_only", "train.tensor_parallel_size"),
    (["train.backend=megatron", "train.expert_parallel_size=2", "cluster.cpu_workers_per_node=2"],
     "expert_parallelism", "train.expert_parallel_size"),
    (["train.backend=megatron", "train.context_parallel_size=2", "cluster.cpu_workers_per_node=2"],
     "megatron_layouts", "train.sequence_packing"),
    (["train.backend=megatron", "train.pipeline_parallel_size=2", "train.dynamic_batching=true",
      "cluster.cpu_workers_per_node=2"], "megatron_layouts", "train.dynamic_batching"),
    (["model.num_kv_heads=3"], "heads_divide", "model.num_kv_heads"),
    (["rollout.max_new_tokens=60"], "sequence_lengths", "rollout.max_new_tokens"),
    (["rollout.max_model_len=10"], "sequence_lengths", "rollout.max_model_len"),
    (["env=nemo_gym", "rollout=vllm", "rollout.async_engine=false", "rollout.expose_http_server=true",
      "env.max_prompt_tokens=16"], "gym_needs_async_http_vllm", "rollout.async_engine"),
    (["rollout.async_engine=true"], "vllm_only_switches", "rollout.async_engine"),
    (["rollout.top_p=0.9"], "sampling_keeps_logprobs_exact", "rollout.top_p"),
    (["rollout.colocated=false"], "colocated_only", "rollout.colocated"),
    (["loss.dual_clip_c=0.5"], "loss_ranges", "loss.dual_clip_c"),
    (["loss=gspo", "loss.aggregation=token_mean"], "sequence_ratios_need_sequence_loss", "loss.aggregation"),
    (["loss.is_truncation=tis"], "importance_sampling_truncation", "loss.importance_sampling_correction"),
    (["grpo.max_val_samples=4"], "validation_sizes", "grpo.max_val_samples"),
    (["checkpoint.save_period=5"], "checkpoint_metric_is_produced", "checkpoint.save_period"),
    (["checkpoint.metric=val/reward"], "checkpoint_metric_is_produced", "checkpoint.metric"),
    (["cluster.nodes=2"], "local_is_one_node", "cluster.nodes"),
    (["cluster=slurm", "cluster.partition='x; touch /tmp/p'"], "slurm_fields", "cluster.partition"),
    (["cluster=slurm", "cluster.requires_account=true"], "slurm_fields", "cluster.account"),
    (["cluster.ray_temp_dir=/tmp/a/very/long/path/that/ray/sockets/will/overflow"],
     "ray_temp_dir_short", "cluster.ray_temp_dir"),
    (["cluster=slurm", "cluster.time=04:00:00", "checkpoint.must_save_by=03:58:00"], "time_budget",
     "checkpoint.must_save_by"),
    (["cluster.time=four hours"], "time_budget", "cluster.time"),
    (["name=a/b"], "safe_names", "name"),
    (["model.path=/nonexistent/model"], "local_paths_exist", "model.path"),
    (["env=dataset", "env.prompt_key=question"], "env_data_and_code", "env.train_path"),
    (["cluster=slurm", "cluster.python=/x y"], "shell_values", "cluster.python"),
    (["cluster=local_slurm", "cluster.gpus_per_node=8"], "slurm_node_shape", "cluster.gpus_per_node"),
    (["train.backend=megatron", "model.num_experts=4", "model.moe_top_k=2", "train.moe.token_dispatcher=nope"],
     "megatron_moe", "train.moe.token_dispatcher"),
    (["train.backend=megatron", "train.transformer_engine=false", "cluster.cpu_workers_per_node=2",
      "train.tensor_parallel_size=2", "train.sequence_parallel=true"],
     "megatron_needs_transformer_engine", "train.sequence_parallel"),
    (["train.backend=megatron", "train.core_attention=flash"], "megatron_shapes", "train.core_attention"),
    (["train.backend=megatron", "train.pipeline_parallel_size=2", "cluster.cpu_workers_per_node=2"],
     "megatron_worker_implements_layout", "train.pipeline_parallel_size"),
    (["rollout=vllm", "rollout.kv_cache_memory_mb=0"], "vllm_engine_memory_and_length", "rollout.kv_cache_memory_mb"),
]


@pytest.mark.parametrize("overrides,rule,key", FAILING, ids=[f"{r}:{k}" for _, r, k in FAILING])
def test_rule_names_its_key(overrides, rule, key):
    found = violations(overrides)
    assert any(v.rule == rule and key in v.keys for v in found), [v.render() for v in found]
    assert all(v.fix for v in found)


def test_every_rule_has_a_failing_case():
    assert set(RULES) <= {rule for _, rule, _ in FAILING}


def test_all_violations_reported_at_once():
    found = violations(["grpo.num_promts_per_step=3", "train.global_batch_size=12", "loss.clip_low=2"])
    assert {v.rule for v in found} >= {"unknown_key", "rollout_batch_divisible_by_gbs", "loss_ranges"}


def test_typo_suggests_nearest_key():
    (v,) = violations(["grpo.num_promts_per_step=3"])
    assert v.keys == ("grpo.num_promts_per_step",) and "grpo.num_prompts_per_step" in v.fix


@pytest.mark.parametrize("overrides,key", [
    (["rollout.backend=vlm"], "rollout.backend"),
    (["train.lr=abc"], "train.lr"),
    (["model=nope"], "model"),
])
def test_composition_errors_name_the_key(overrides, key):
    (v,) = violations(overrides)
    assert v.keys[0] == key


def test_max_val_samples_null_means_all():
    assert load_spec(["grpo.max_val_samples=null"]).grpo.max_val_samples is None


@pytest.mark.parametrize("text,seconds", [("04:00:00", 14400), ("30", 1800), ("10:30", 630), ("1-02", 93600),
                                          ("2-00:00:05", 172805)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


# ------------------------------------------------------------------ the CLI, as a user runs it


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_cli_nanov3_slurm_dry_run(launch_cmd):
    p = run([*launch_cmd, "+recipe=nanov3", "cluster=slurm", "dry_run=true"])
    assert p.returncode == 0, p.stderr
    assert "#SBATCH --nodes=32" in p.stdout and "#SBATCH --gpus-per-node=8" in p.stdout
    assert "ray start" in p.stdout and "grpo_launcher.train.driver" in p.stdout


def test_cli_bad_config_exits_2_without_traceback(launch_cmd):
    p = run([*launch_cmd, "+recipe=nanov3", "cluster=slurm", "dry_run=true", "rollout.async_engine=false"])
    assert p.returncode == 2
    assert p.stderr.startswith("config error") and "rollout.async_engine" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout and "#SBATCH" not in p.stdout


def test_cli_typo_did_you_mean(launch_cmd):
    p = run([*launch_cmd, "dry_run=true", "grpo.val_perod=3"])
    assert p.returncode == 2 and "did you mean 'grpo.val_period'" in p.stderr and "Traceback" not in p.stderr


def test_cli_unparsable_override(launch_cmd):
    p = run([*launch_cmd, "cluster=slurm", "dry_run=true", 'cluster.container_image=x";touch /tmp/p'])
    assert p.returncode == 2 and "cluster.container_image" in p.stderr and "Traceback" not in p.stderr
