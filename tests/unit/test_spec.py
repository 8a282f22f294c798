"""Compose the real conf/ with Hydra: every option composes, every rule fires with its key named."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from grpo_launcher.plan import make_plan, parse_duration
from grpo_launcher.preflight.registry import V, Rule
from grpo_launcher.preflight.validate import registered, rule_names, validate
from grpo_launcher.spec.compose import CONF_DIR, load_spec, spec_to_yaml
from grpo_launcher.spec.errors import ConfigError
from grpo_launcher.spec.schema import RunSpec

from helpers import TESTS

SNAPSHOT = TESTS / "snapshots" / "nanov3_slurm.yaml"
SLURM_OK = ["cluster=slurm", "dry_run=true"]
HTTP = ["rollout=vllm", "rollout.async_engine=true", "rollout.expose_http_server=true"]


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
    elif cluster == "ray":  # an existing cluster may have 32 nodes; none is named here (RAY_ADDRESS unset)
        assert {v.rule for v in violations(overrides)} == {"ray_cluster_reachable"}
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


def test_nanov3_snapshot(monkeypatch):
    monkeypatch.setenv("GRPO_OUTPUT_ROOT", "outputs")  # the default a user without the variable gets (conftest.py)
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


def test_nanov3_layout_follows_the_backend_and_explicit_overrides_stay_refused():
    """The recipe's TP2/PP2/CP4/EP8 + SP are Megatron's; train.backend=torch resolves them to FSDP2's 1s (in the
    spec and its YAML), and a user's own train.tensor_parallel_size=2 on torch is still refused."""
    def layout(s):
        t = s.train
        return (t.tensor_parallel_size, t.pipeline_parallel_size, t.context_parallel_size,
                t.expert_parallel_size, t.sequence_parallel)

    assert layout(load_spec(["+recipe=nanov3", *SLURM_OK])) == (2, 2, 4, 8, True)
    short = ["rollout.max_new_tokens=4096", "rollout.max_model_len=8192", "train.max_total_sequence_length=8192"]
    torch_spec = load_spec(["+recipe=nanov3", *SLURM_OK, "train.backend=torch", *short])
    assert layout(torch_spec) == (1, 1, 1, 1, False)
    assert "tensor_parallel_size: 1\n" in spec_to_yaml(torch_spec) and "${" not in spec_to_yaml(torch_spec)
    found = violations(["+recipe=nanov3", *SLURM_OK, "train.backend=torch", "train.tensor_parallel_size=2", *short])
    assert [(v.rule, v.keys[0]) for v in found] == [("torch_backend_is_data_parallel_only",
                                                     "train.tensor_parallel_size")]


def test_per_backend_without_a_value_for_the_backend_names_the_key(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text(
        '# @package _global_\ntrain:\n  tensor_parallel_size: "${per_backend:{megatron: 2}}"\n')
    from grpo_launcher.spec.compose import ConfigSource

    with pytest.raises(ConfigError) as info:
        load_spec(["+recipe=mine", "train.backend=torch"], source=ConfigSource(search_path=(str(tmp_path),)))
    (v,) = info.value.violations
    assert v.keys == ("train.tensor_parallel_size",) and "no value for train.backend=torch" in v.message


# (overrides, rule, key that must be named). Every rule (preflight/*.py and each ROOM/rules.py) appears at least once.
FAILING = [
    (["grpo.max_steps=0"], "positive_sizes", "grpo.max_steps"),
    (["cluster=slurm", "cluster.cpus_per_worker=0"], "positive_sizes", "cluster.cpus_per_worker"),
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
    (["train.cpu_offload=true"], "cpu_offload_needs_torch_on_gpus", "train.cpu_offload"),
    (["train.cpu_offload=true", "train.backend=megatron", "cluster.gpus_per_node=1"],
     "cpu_offload_needs_torch_on_gpus", "train.backend"),
    (["train.backend=megatron", "train.expert_parallel_size=2", "cluster.cpu_workers_per_node=2"],
     "expert_parallelism", "train.expert_parallel_size"),
    (["train.backend=megatron", "train.context_parallel_size=2", "cluster.cpu_workers_per_node=2"],
     "megatron_layouts", "train.sequence_packing"),
    (["train.backend=megatron", "train.tensor_parallel_size=1", "train.sequence_parallel=true"],
     "megatron_layouts", "train.sequence_parallel"),
    (["model.num_kv_heads=3"], "heads_divide", "model.num_kv_heads"),
    (["rollout.max_new_tokens=60"], "sequence_lengths", "rollout.max_new_tokens"),
    (["rollout.max_model_len=10"], "sequence_lengths", "rollout.max_model_len"),
    (["env=nemo_gym", "rollout=vllm", "rollout.async_engine=false", "rollout.expose_http_server=true",
      "env.max_prompt_tokens=16"], "gym_needs_async_http_vllm", "rollout.async_engine"),
    (["rollout.async_engine=true"], "vllm_only_switches", "rollout.async_engine"),
    (["rollout.temperature=0"], "sampling_keeps_logprobs_exact", "rollout.temperature"),
    (["loss.dual_clip_c=0.5"], "loss_ranges", "loss.dual_clip_c"),
    (["loss=gspo", "loss.aggregation=token_mean"], "sequence_ratios_need_sequence_loss", "loss.aggregation"),
    (["loss.is_truncation=tis"], "importance_sampling_truncation", "loss.importance_sampling_correction"),
    (["grpo.max_val_samples=4"], "validation_sizes", "grpo.max_val_samples"),
    (["grpo.max_steps=2", "grpo.val_period=5", "checkpoint.save_period=5", "grpo.val_at_end=false"],
     "checkpoint_metric_is_produced", "grpo.val_at_end"),  # no step validates: top-k ranked nothing, exit 0
    (["grpo.max_steps=12", "grpo.val_period=5", "checkpoint.save_period=4", "grpo.val_at_end=false",
      "grpo.val_at_start=true"], "checkpoint_metric_is_produced", "checkpoint.save_period"),  # lcm 20 > 12
    (["checkpoint.metric=val/reward"], "checkpoint_metric_is_produced", "checkpoint.metric"),
    # the exposed vLLM HTTP server's bind address: an OSError after start-up, or every interface silently
    (HTTP + ["rollout.http_host=1.2.3.4"], "http_host_bindable", "rollout.http_host"),  # not this machine's
    (HTTP + ["rollout.http_host=2001:db8::1"], "http_host_bindable", "rollout.http_host"),  # an IPv6 literal too
    (HTTP + ["rollout.http_host=no-such-host.invalid"], "http_host_bindable", "rollout.http_host"),  # gaierror
    (HTTP + ["rollout.http_host=''"], "http_host_bindable", "rollout.http_host"),
    (HTTP + SLURM_OK + ["rollout.http_host=''"], "http_host_bindable", "rollout.http_host"),
    (HTTP + SLURM_OK + ["rollout.http_host=bad_host"], "http_host_bindable", "rollout.http_host"),
    (HTTP + SLURM_OK + ["rollout.http_host='[::1]'"], "http_host_bindable", "rollout.http_host"),
    (["cluster.nodes=2"], "local_is_one_node", "cluster.nodes"),
    (["cluster.gpus_per_node=1"], "local_gpus_present", "cluster.gpus_per_node"),  # this CPU machine has none
    (["cluster=ray", "cluster.ray_address=127.0.0.1:1"], "ray_cluster_reachable", "cluster.ray_address"),
    (["logging.wandb=true", "logging.experiment=a:b"], "trackers_installed", "logging.wandb"),
    (["cluster=slurm", "cluster.partition='x; touch /tmp/p'"], "slurm_fields", "cluster.partition"),
    (["cluster=slurm", "cluster.requires_account=true"], "slurm_fields", "cluster.account"),
    (["cluster.ray_temp_dir=/tmp/a/very/long/path/that/ray/sockets/will/overflow"],
     "ray_temp_dir_short", "cluster.ray_temp_dir"),
    (["cluster=slurm", "cluster.time=04:00:00", "checkpoint.must_save_by=03:58:00"], "time_budget",
     "checkpoint.must_save_by"),
    (["cluster.time=four hours"], "time_budget", "cluster.time"),
    (["name=a/b"], "safe_names", "name"),
    (["model.path=/nonexistent/model"], "local_paths_exist", "model.path"),
    ([f"model.path={TESTS / 'data' / 'truncated_weights'}"], "model_weights_readable", "model.path"),
    ([f"model.path={TESTS / 'data' / 'pickled_weights'}"], "model_weights_readable", "model.path"),  # not loaded
    (["model.vocab_size=100"], "value_ranges", "model.vocab_size"),  # the tiny tokenizer's 259: built silently
    (["env=dataset", "env.prompt_key=question"], "env_data_and_code", "env.train_path"),
    ([f"output_root={TESTS / 'data' / 'finished_run'}"], "run_name_not_finished", "name"),
    ([f"output_root={TESTS / 'data' / 'incompatible_run'}"], "run_name_checkpoints_compatible",
     "model.hidden_size"),
    ([f"output_root={TESTS / 'data' / 'moved_store_run'}"], "run_name_keeps_its_tracking_store",
     "logging.tracking_uri"),
    (["logging.tracking_uri=bogus://x"], "mlflow_values", "logging.tracking_uri"),
    (["cluster=slurm", "cluster.python=/x y"], "shell_values", "cluster.python"),
    (["cluster=slurm", "output_root=/tmp/a\\b"], "slurm_log_paths", "output_root"),
    (["cluster=local_slurm", "cluster.gpus_per_node=8"], "slurm_node_shape", "cluster.gpus_per_node"),
    (["train.backend=megatron", "model.num_experts=4", "model.moe_top_k=2", "train.moe.token_dispatcher=nope"],
     "megatron_moe", "train.moe.token_dispatcher"),
    (["train.backend=megatron", "train.transformer_engine=false", "cluster.cpu_workers_per_node=2",
      "train.tensor_parallel_size=2", "train.sequence_parallel=true"],
     "megatron_needs_transformer_engine", "train.sequence_parallel"),
    (["train.backend=megatron", "train.core_attention=flash"], "megatron_shapes", "train.core_attention"),
    (["train.backend=megatron", "train.distributed_optimizer=true"], "build_implements_run",
     "train.distributed_optimizer"),  # CPU: torch's Adam (was a worker's NotImplementedError after start)
    (["train.backend=megatron", "model.family=gemma2"], "megatron_logits_as_the_family_makes_them", "model.family"),
    (["train.backend=megatron", "train.pipeline_parallel_size=2", "cluster.cpu_workers_per_node=2"],
     "megatron_worker_implements_layout", "train.pipeline_parallel_size"),
    (["rollout=vllm", "rollout.kv_cache_memory_mb=0"], "vllm_engine_memory_and_length", "rollout.kv_cache_memory_mb"),
    (["cluster=slurm", "cluster.gpus_per_node=1", "cluster.gpu_memory_gib=-1", "dry_run=true"],
     "gpu_memory_fits", "cluster.gpu_memory_gib"),
    (["env=nemo_gym", "rollout=vllm", "rollout.async_engine=true", "rollout.expose_http_server=true",
      "env.max_prompt_tokens=16", "env.gym_start_timeout_s=0", "dry_run=true"], "gym_preflight",
     "env.gym_start_timeout_s"),
    # issue 11: configs that passed pre-flight and failed after allocation
    (["train.lr=0"], "optimizer_ranges", "train.lr"),
    (["train.lr=-1e-4"], "optimizer_ranges", "train.lr"),
    (["train.weight_decay=-0.1"], "optimizer_ranges", "train.weight_decay"),
    (["train.max_grad_norm=0"], "optimizer_ranges", "train.max_grad_norm"),
    (["train.warmup_steps=-1"], "optimizer_ranges", "train.warmup_steps"),
    (["checkpoint.metric=train/loss"], "checkpoint_metric_direction", "checkpoint.higher_is_better"),
    (["checkpoint.higher_is_better=false"], "checkpoint_metric_direction", "checkpoint.higher_is_better"),
    (["cluster.object_store_memory_mb=50"], "ray_object_store_minimum", "cluster.object_store_memory_mb"),
    (["train.backend=megatron", "train.tensor_parallel_size=4", "cluster.cpu_workers_per_node=4",
      "model.num_kv_heads=4", "train.micro_batch_size=8", "train.logprob_batch_size=16"],
     "tp4_logprob_batch_matches_micro_batch", "train.logprob_batch_size"),
    (["rollout=vllm", "rollout.max_model_len=32", "train.max_total_sequence_length=64"],
     "sequence_lengths", "rollout.max_model_len"),
    (["name=.."], "safe_names", "name"),
    (["name=.hidden"], "safe_names", "name"),
    (["name=multirun"], "safe_names", "name"),  # output_root's own entries (the sweeps' folder, the stores)
    (["name=optuna.db"], "safe_names", "name"),  # blamed output_root ("a directory you can write") at b11b41e
    (["loss.importance_sampling_correction=true", "loss.is_truncation=icepop", "loss.is_threshold=5",
      "loss.is_threshold_low=1.5"], "importance_sampling_truncation", "loss.is_threshold_low"),
    (["loss.is_threshold_low=0.5"], "importance_sampling_truncation", "loss.is_threshold_low"),
    # async GRPO and separate rollout devices (train/async_loop.py)
    (["cluster.rollout_devices=1"], "separate_rollout_devices", "cluster.rollout_devices"),
    (["cluster.rollout_devices=-1"], "separate_rollout_devices", "cluster.rollout_devices"),
    (["grpo.async_grpo.enabled=true", "cluster.rollout_devices=0"], "async_grpo_combinations", "cluster.rollout_devices"),
    (["grpo.async_grpo.max_trajectory_age_steps=0"], "async_grpo_combinations",
     "grpo.async_grpo.max_trajectory_age_steps"),
    (["grpo.async_grpo.in_flight_weight_updates=true"], "async_grpo_combinations",
     "grpo.async_grpo.in_flight_weight_updates"),
    (["grpo.async_grpo.enabled=true", "cluster.cpu_workers_per_node=2", "cluster.rollout_devices=1", "loss=dapo"],
     "async_grpo_combinations", "loss.dynamic_sampling"),
    (["grpo.async_grpo.enabled=true", "cluster.cpu_workers_per_node=2", "cluster.rollout_devices=1", "rollout=vllm"],
     "async_grpo_combinations", "loss.importance_sampling_correction"),
    (["deadlines.health_timeout_s=0"], "deadlines_health_keys", "deadlines.health_timeout_s"),
    # what this build cannot run: refused before submission (dry runs still plan)
    (["+recipe=nanov3", "cluster=slurm"], "build_implements_run", "model.family"),
    (["+recipe=nanov3", "cluster=slurm"], "build_implements_run", "train.sequence_packing"),
    (["model.family=llama"], "build_implements_run", "model.family"),
    # values that used to crash the validator or break the job's spec.yaml
    (["train.lr=inf"], "field_values", "train.lr"),
    (["loss.clip_high=nan"], "field_values", "loss.clip_high"),
    (["grpo.seed=" + "9" * 300], "field_values", "grpo.seed"),
    (["cluster.time='01:00:00\n'"], "field_values", "cluster.time"),  # a real line break in the value
    (["output_root='out\nx'"], "field_values", "output_root"),
    (["logging.experiment='\\${oops}'"], "field_values", "logging.experiment"),
    (["cluster.env_passthrough=[[A]]"], "field_values", "cluster.env_passthrough"),
    (["cluster.container_mounts=${train.lr}"], "field_values", "cluster.container_mounts"),  # a float in a list key
    # ranges that used to pass pre-flight and fail minutes later (a traceback, a hung-run exit, a refused sbatch)
    (["env.num_val_prompts=0"], "value_ranges", "env.num_val_prompts"),
    (["env.max_prompt_tokens=-1"], "value_ranges", "env.max_prompt_tokens"),
    (["deadlines.factor=0"], "value_ranges", "deadlines.factor"),
    (["deadlines.floor_s=-1"], "value_ranges", "deadlines.floor_s"),
    (["deadlines.window=0"], "value_ranges", "deadlines.window"),
    (["deadlines.stop_grace_s=-1"], "value_ranges", "deadlines.stop_grace_s"),
    (["cluster=slurm", "cluster.signal_before_s=-5"], "value_ranges", "cluster.signal_before_s"),
    (["cluster.ray_join_timeout_s=0"], "value_ranges", "cluster.ray_join_timeout_s"),
    (["model.num_layers=0"], "value_ranges", "model.num_layers"),
    (["model.vocab_size=-1"], "value_ranges", "model.vocab_size"),
    (["model.warm_start_steps=-1"], "value_ranges", "model.warm_start_steps"),
    (["rollout.gpu_memory_utilization=5"], "value_ranges", "rollout.gpu_memory_utilization"),
    (["rollout=vllm", "cluster.gpus_per_node=1", "rollout.gpu_memory_utilization=0"],
     "value_ranges", "rollout.gpu_memory_utilization"),
    (["cluster=slurm", "cluster.time=99:99:99"], "time_budget", "cluster.time"),
    (["output_root=/dev/null/runs"], "output_root_writable", "output_root"),
    (["grpo.max_steps=10000000", "checkpoint.keep_top_k=10000000"], "checkpoint_disk_room", "checkpoint.keep_top_k"),
    (["logging.tracking_uri=http://127.0.0.1:9"], "tracking_store_reachable", "logging.tracking_uri"),
    (["rollout=vllm", "rollout.hf_compile=true"], "vllm_only_switches", "rollout.hf_compile"),
    (["rollout=vllm", f"model.path={TESTS / 'data' / 'stablelm_qk_layernorm'}"], "vllm_model_reads_the_checkpoint",
     "model.path"),
]


@pytest.mark.parametrize("overrides,rule,key", FAILING, ids=[f"{r}:{k}" for _, r, k in FAILING])
def test_rule_names_its_key(overrides, rule, key):
    found = violations(overrides)
    assert any(v.rule == rule and key in v.keys for v in found), [v.render() for v in found]
    assert all(v.fix for v in found)


@pytest.mark.parametrize("overrides", [
    ["grpo.val_period=0", "grpo.val_at_end=true"],  # validation at the last step, which is always checkpointed
    ["checkpoint.save_period=5"],  # saves at 5, 15, ... carry no val metric, those at 10, 20, ... do
    ["grpo.max_steps=10", "grpo.val_period=5", "checkpoint.save_period=4", "grpo.val_at_end=false"],  # 10 % 5 == 0
    ["grpo.max_steps=2", "grpo.val_period=0", "grpo.val_at_end=false", "checkpoint.metric=train/reward_mean"],
])
def test_checkpoint_metric_produced_at_a_checkpoint(overrides):
    """checkpoint_metric_is_produced refuses only when no checkpoint the run saves carries the val/ metric."""
    load_spec(overrides)


def test_checkpoint_metric_fix_is_concrete():
    (v,) = [v for v in violations(["grpo.max_steps=2", "grpo.val_period=5", "checkpoint.save_period=5",
                                   "grpo.val_at_end=false"]) if v.rule == "checkpoint_metric_is_produced"]
    assert "grpo.val_at_end=true" in v.fix and "grpo.val_period=2" in v.fix
    load_spec(["grpo.max_steps=2", "grpo.val_period=2", "checkpoint.save_period=5", "grpo.val_at_end=false"])


@pytest.mark.parametrize("overrides", [
    HTTP,  # 127.0.0.1
    HTTP + ["rollout.http_host=localhost"],
    HTTP + ["rollout.http_host=0.0.0.0"],  # every interface, asked for explicitly
    HTTP + SLURM_OK + ["rollout.http_host=1.2.3.4"],  # the node binds it: only its syntax is checked here
    HTTP + SLURM_OK + ["rollout.http_host=gpu-node-17.cluster"],
    HTTP + SLURM_OK + ["rollout.http_host=2001:db8::1"],
    ["rollout.http_host=1.2.3.4"],  # no HTTP server: the host is never bound
])
def test_http_host_accepted(overrides):
    load_spec(overrides)


def test_http_host_error_names_the_os_reason():
    (v,) = [v for v in violations(HTTP + ["rollout.http_host=1.2.3.4"]) if v.rule == "http_host_bindable"]
    assert v.keys == ("rollout.http_host",) and "Errno" in v.message and "127.0.0.1" in v.fix


def test_http_host_all_interfaces_without_api_key_warns(capsys):
    load_spec(HTTP + ["rollout.http_host=0.0.0.0", "rollout.http_api_key=''"])
    err = capsys.readouterr().err
    assert err.count("warning: rollout.http_host=0.0.0.0") == 1 and "no API key" in err
    load_spec(HTTP + ["rollout.http_host=0.0.0.0", "rollout.http_api_key=k"])  # a key: no warning
    assert "warning" not in capsys.readouterr().err


def test_every_rule_has_a_failing_case():
    assert rule_names() <= {rule for _, rule, _ in FAILING}


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


@pytest.mark.parametrize("text", ["99:99:99", "10:60", "1-24", "1-00:60:00", "1h"])
def test_parse_duration_refuses_slips(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_a_rule_that_crashes_on_values_named_elsewhere_stays_silent():
    """TP=0 makes the divisibility rules divide by zero: the range rule names the key; no Python error is shown."""
    found = violations(["train.tensor_parallel_size=0"])
    assert any("train.tensor_parallel_size" in v.keys for v in found)
    assert not any("could not evaluate" in v.message for v in found), [v.render() for v in found]


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


# ------------------------------------------------------------------ issue 11: keys, groups, crashes, round-trip


@pytest.mark.parametrize("key", sorted(__import__("grpo_launcher.spec.compose", fromlist=["x"]).REMOVED_KEYS))
def test_removed_keys_say_why(key):
    (v,) = violations([f"{key}=1"])
    assert v.rule == "unknown_key" and v.keys == (key,) and v.fix.startswith("removed:")


@pytest.mark.parametrize("override,rule,key", [
    ("model=[tiny,tiny]", "config_group", "model"),
    ("model=null", "config_group", "model"),
    ("env=[]", "config_group", "env"),
    ("+recipe=null", "config_group", "recipe"),
    ("train=${model}", "composition", "train"),
    ("train=5", "composition", "train"),
    ("grpo.seed=1,2", "override_syntax", "grpo.seed"),
    ("hydra.run.dir=/tmp/x", "hydra_key", "hydra.run.dir"),
    ("hydra.job.chdir=true", "hydra_key", "hydra.job.chdir"),
])
def test_bad_shapes_of_overrides_are_config_errors(override, rule, key):
    found = violations([override])
    assert any(v.rule == rule and v.keys[0] == key for v in found), [v.render() for v in found]


def test_validator_survives_a_crashing_rule(monkeypatch):
    def broken(spec):
        raise TypeError("boom")

    spec = load_spec([])
    monkeypatch.setitem(registered(), "broken", Rule("broken", "pure", broken))
    (v,) = [v for v in validate(spec) if v.rule == "broken"]
    assert "TypeError: boom" in v.message


def test_a_dry_run_skips_the_probes_in_validate_only(monkeypatch):
    """validate() skips every probe-kind rule for dry_run=true and runs it otherwise; no rule asks dry_run itself."""
    import dataclasses
    import inspect

    def asks_this_machine(spec):
        yield V("asks_this_machine", "cluster.kind", "asked", "none")

    spec = load_spec(["dry_run=true"])
    monkeypatch.setitem(registered(), "asks_this_machine", Rule("asks_this_machine", "probe", asks_this_machine))
    assert "asks_this_machine" not in {v.rule for v in validate(spec)}
    assert "asks_this_machine" in {v.rule for v in validate(dataclasses.replace(spec, dry_run=False))}
    assert {r.kind for r in registered().values()} == {"pure", "probe"}
    assert not [name for name, r in registered().items() if ".dry_run" in inspect.getsource(r.check)]


def test_spec_roundtrip_detects_what_the_job_would_read_differently():
    import dataclasses

    from grpo_launcher.spec.compose import roundtrip_problems

    spec = load_spec([])
    assert roundtrip_problems(spec) == []
    bad = dataclasses.replace(spec, logging=dataclasses.replace(spec.logging, experiment="${oops}"))
    assert any("logging.experiment" in v.keys or v.keys == ("<spec>",) for v in roundtrip_problems(bad))


def test_preflight_renders_and_roundtrips_slurm():
    from grpo_launcher.launch.preflight import preflight

    spec, plan = preflight(["cluster=slurm", "dry_run=true"])
    assert plan.world_size == 1 and spec.cluster.kind.value == "slurm"


# ------------------------------------------------------------------ issue 13: model.path=DIR is enough


def write_model_dir(path: Path, pad: bool = True, eos: bool = True, **config) -> Path:
    import json

    path.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "qwen2", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 96, "vocab_size": 300, "max_position_embeddings": 256,
           "tie_word_embeddings": False, **config}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "tokenizer.json").write_text("{}")
    tokens = {**({"eos_token": "<eos>"} if eos else {}), **({"pad_token": "<pad>"} if pad else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(tokens))
    return path


def test_model_path_alone_gives_the_architecture(tmp_path):
    d = write_model_dir(tmp_path / "my-qwen")
    m = load_spec([f"model.path={d}", "train.max_total_sequence_length=64"]).model
    assert (m.name, m.family, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads,
            m.ffn_hidden_size, m.vocab_size, m.max_position_embeddings) == ("my-qwen", "qwen2", 3, 64, 2, 1, 96, 300, 256)


def test_model_path_contradiction_is_a_config_error(tmp_path):
    d = write_model_dir(tmp_path / "m")
    found = violations([f"model.path={d}", "model.num_layers=4"])
    (v,) = [v for v in found if v.rule == "model_matches_checkpoint"]
    assert v.keys == ("model.num_layers", "model.path") and "num_hidden_layers=3" in v.message


def test_model_path_checkpoint_rules_check_the_checkpoint_shape(tmp_path):
    d = write_model_dir(tmp_path / "m", num_attention_heads=3, hidden_size=64, num_key_value_heads=3)
    assert "heads_divide" in {v.rule for v in violations([f"model.path={d}"])}  # 64 / 3 heads, from config.json


@pytest.mark.parametrize("breakage,needle", [
    ("no_config", "has no config.json"),
    ("corrupt", "line 2"),
    ("no_eos", "no eos_token"),
    ("no_tokenizer", "has no tokenizer"),
])
def test_broken_model_dirs_are_named(tmp_path, breakage, needle):
    d = write_model_dir(tmp_path / "m", eos=breakage != "no_eos")
    if breakage == "no_config":
        (d / "config.json").unlink()
    elif breakage == "corrupt":
        (d / "config.json").write_text('{\n  "model_type": qwen2\n}')
    elif breakage == "no_tokenizer":
        (d / "tokenizer.json").unlink()
    found = violations([f"model.path={d}"])
    assert any(needle in v.message and "model.path" in v.keys for v in found), [v.render() for v in found]


def test_a_tokenizer_without_a_pad_token_is_accepted(tmp_path):
    """Llama-3's and Mistral's tokenizers declare no pad token: the EOS pads (rollout/hf.py load_tokenizer), so
    pre-flight must not refuse them (it did: rule model_tokenizer, 'no pad_token')."""
    d = write_model_dir(tmp_path / "m", pad=False)
    assert load_spec([f"model.path={d}", "train.max_total_sequence_length=64"]).model.path == str(d)


@pytest.mark.parametrize("installed", [False, True])
def test_nemo_gym_refused_for_a_real_launch_unless_installed(monkeypatch, installed):
    from grpo_launcher.gym import rules as gym_rules

    monkeypatch.setattr(gym_rules, "gym_available", lambda: installed)
    spec = load_spec(["+recipe=nanov3", "cluster=slurm", "dry_run=true"])
    real = __import__("dataclasses").replace(spec, dry_run=False)
    gym = [v for v in validate(real) if v.rule == "build_implements_run" and "env.name" in v.keys]
    assert bool(gym) != installed


def test_resuming_a_name_whose_checkpoints_are_incompatible_is_refused_before_anything_is_written(tmp_path):
    """The job would refuse it too, but only after it built a model and rewrote spec.yaml and status.json."""
    from grpo_launcher.checkpoint.manager import compat_fingerprint

    spec = load_spec([f"output_root={tmp_path}", "name=r", "grpo.max_steps=4"])
    step = tmp_path / "r" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    compat = dict(compat_fingerprint(spec), **{"model.hidden_size": 64})
    (step / "meta.json").write_text(json.dumps({"step": 2, "compat": compat}))
    with pytest.raises(ConfigError) as exc:
        load_spec([f"output_root={tmp_path}", "name=r", "grpo.max_steps=4"])
    (v,) = [v for v in exc.value.violations if v.rule == "run_name_checkpoints_compatible"]
    assert v.keys == ("model.hidden_size", "checkpoint.resume") and "64 → 128" in v.message
    load_spec([f"output_root={tmp_path}", "name=r", "grpo.max_steps=4", "model.hidden_size=64"])  # compatible
    load_spec([f"output_root={tmp_path}", "name=r", "grpo.max_steps=4", "checkpoint.resume=fresh"])
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["checkpoints"]  # nothing written


def test_a_missing_data_file_is_named_alone():
    """env=dataset with a train file that is not there: that file is the one problem named (the prompt budget it
    would have been counted from stays silent, instead of two errors about a budget of 0)."""
    found = violations(["env=dataset", "env.train_path=/nonexistent/train.jsonl"])
    assert [v.keys[0] for v in found] == ["env.train_path"], [v.render() for v in found]


def test_no_fix_asks_for_a_generation_of_zero_tokens():
    found = violations(["env.max_prompt_tokens=64", "train.max_total_sequence_length=64"])
    (v,) = [v for v in found if v.rule == "sequence_lengths"]
    assert "≤ 0" not in v.fix and "train.max_total_sequence_length ≥ 72" in v.fix, v.render()


def test_no_two_fixes_contradict_each_other_on_a_budget_past_the_models_positions():
    """A 1201-token prompt budget on a 1024-position model was told "set train.max_total_sequence_length ≥ 1209"
    and "≤ 1024" at once: no value does both. Now the budget past the positions is the one fix."""
    found = [v for v in violations(["env.max_prompt_tokens=1201", "rollout.max_new_tokens=8"])
             if v.rule == "sequence_lengths"]
    assert [v.keys[0] for v in found] == ["env.max_prompt_tokens"], [v.render() for v in found]
    assert "to a sum ≤ 1024" in found[0].fix and "≥" not in found[0].fix


@pytest.mark.parametrize("root", ["/dev/null/runs", "/proc/grpo-nope"])
def test_cli_an_output_root_that_cannot_be_made_exits_2(launch_cmd, root):
    """Under a file (the pre-flight sees it), or where even root cannot make a directory (/proc: only the attempt
    tells): exit 2 naming output_root, no traceback, nothing started."""
    p = run([*launch_cmd, f"output_root={root}", "grpo.max_steps=1", "logging.mlflow=false"])
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "config error" in p.stderr and "output_root" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_cli_export_of_what_is_not_a_run_exits_2(launch_cmd, tmp_path):
    p = run([*launch_cmd, "export", str(tmp_path / "no-such-run")])
    assert p.returncode == 2 and p.stderr.startswith("config error") and "run_dir" in p.stderr, p.stderr


def test_a_group_label_set_on_its_own_is_refused():
    """loss.name=dapo alone trained plain GRPO labelled 'dapo' (no code reads the label): refused, naming the group."""
    found = violations(["loss.name=dapo"])
    assert [v.rule for v in found] == ["group_label"] and "loss=NAME (dapo, dr_grpo, grpo, gspo)" in found[0].fix
    assert load_spec(["loss=dapo"]).loss.name == "dapo"


def test_the_tiny_tokenizer_size_the_vocab_rule_holds_is_the_tokenizers():
    from grpo_launcher.models.tiny import TOKENIZER_SIZE, build_tokenizer

    assert len(build_tokenizer()) == TOKENIZER_SIZE


@pytest.mark.parametrize("limit", ["UNLIMITED", "infinite", "0"])
def test_slurm_time_without_a_limit_is_accepted(limit):
    """Slurm reads UNLIMITED, INFINITE and 0 as no time limit: UNLIMITED was 'not a Slurm duration', and 0 'the save
    signal ... before the job starts (0s)' (found by the config tester)."""
    from grpo_launcher.preflight.validate import validate
    from grpo_launcher.spec.compose import compose, to_spec

    spec = to_spec(compose(["cluster=slurm", f"cluster.time={limit}", "checkpoint.must_save_by=03:00:00"]))
    assert not [v for v in validate(spec) if v.rule == "time_budget"]


def test_a_warm_up_longer_than_the_run_is_a_warning_naming_where_the_learning_rate_ends(capsys):
    """train.warmup_steps past the run's optimizer steps: the learning rate never reaches train.lr. A warning (a
    resume may go on), with the fraction it ends at; within the run, none."""
    validate(load_spec(["train.warmup_steps=50", "grpo.max_steps=10"]))
    err = capsys.readouterr().err
    assert "train.warmup_steps=50 is longer than the run's 10 optimizer steps" in err and "ends at 20% of" in err, err
    validate(load_spec(["train.warmup_steps=10", "grpo.max_steps=10"]))
    assert "warmup" not in capsys.readouterr().err


def test_the_tiny_models_learning_rate_on_a_pretrained_model_is_a_warning(capsys, monkeypatch):
    """train.lr=3e-4 (the default, fit for the tiny model built from scratch) on pretrained weights of ≥ 1e8
    parameters: a warning naming train.lr and the usual range; none at 1e-6, none for a model built here."""
    from grpo_launcher.spec.compose import compose, to_spec

    monkeypatch.setattr("grpo_launcher.envs.preflight._WARNED", set())  # each warning is said once per process
    validate(to_spec(compose(["model=qwen2_5_1_5b"])))  # its model.path is absent here: only the spec is read
    err = capsys.readouterr().err
    assert "train.lr=0.0003 on the pretrained" in err and "1e-7 to 1e-5" in err, err
    validate(to_spec(compose(["model=qwen2_5_1_5b", "train.lr=1e-6"])))
    validate(load_spec(["model=nemotron_h_1b"]))  # model.path null: random weights, warm-started here
    assert "train.lr=" not in capsys.readouterr().err


def test_keys_that_nothing_reads_in_this_configuration_are_named_in_a_warning(capsys):
    """A key set where nothing reads it (loss.kl_clamp with loss.kl_coef=0, Slurm's cluster.partition with
    cluster=local, checkpoint.keep_top_k with checkpoint.enabled=false, vLLM's gpu_memory_utilization with
    rollout=hf) was accepted silently: the user believed it in force. A warning names each key and what switches it
    off; the run goes on. The defaults and every shipped group alone warn of nothing."""
    validate(load_spec(["loss.kl_clamp=5", "cluster.partition=gpu", "checkpoint.enabled=false",
                        "checkpoint.keep_top_k=5", "rollout.gpu_memory_utilization=0.3"]))
    err = capsys.readouterr().err
    for part in ("loss.kl_clamp=5.0 (loss.kl_coef=0: no KL term)", "cluster.partition=gpu (cluster=local",
                 "checkpoint.keep_top_k=5 (checkpoint.enabled=false", "rollout.gpu_memory_utilization=0.3 (rollout=hf"):
        assert part in err, err
    validate(load_spec(["loss.kl_clamp=5", "loss.kl_coef=0.01"]))
    for group in ("loss=dapo", "loss=gspo", "rollout=vllm", "cluster=slurm", "env=math", "model=nemotron_h_1b"):
        validate(load_spec([group]))
    assert "nothing reads" not in capsys.readouterr().err
