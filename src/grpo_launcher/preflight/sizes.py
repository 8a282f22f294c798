"""Sizes and shapes: positive counts, parallel sizes that divide the devices and the batch, the model's heads,
and the sequence lengths the budgets must fit."""

from __future__ import annotations

from typing import Iterator

from ..plan import (
    devices_per_node,
    dp_size,
    engine_devices,
    rollout_model_parallel,
    rollouts_per_step,
    train_devices,
    train_model_parallel,
)
from ..envs.toy import MAX_VAL_PROMPTS, SPACE
from ..models.tiny import TOKENIZER_SIZE
from ..spec.errors import Violation
from ..spec.model_dir import model_facts
from ..spec.schema import ClusterKind, RolloutBackend, RunSpec
from .registry import V, rule


@rule("pure")
def positive_sizes(s: RunSpec) -> Iterator[Violation]:
    sizes = {
        "grpo.num_prompts_per_step": s.grpo.num_prompts_per_step,
        "grpo.max_steps": s.grpo.max_steps,
        "grpo.val_batch_size": s.grpo.val_batch_size,
        "train.global_batch_size": s.train.global_batch_size,
        "train.micro_batch_size": s.train.micro_batch_size,
        "train.logprob_batch_size": s.train.logprob_batch_size,
        "train.tensor_parallel_size": s.train.tensor_parallel_size,
        "train.pipeline_parallel_size": s.train.pipeline_parallel_size,
        "train.context_parallel_size": s.train.context_parallel_size,
        "train.expert_parallel_size": s.train.expert_parallel_size,
        "train.expert_tensor_parallel_size": s.train.expert_tensor_parallel_size,
        "rollout.tensor_parallel_size": s.rollout.tensor_parallel_size,
        "rollout.pipeline_parallel_size": s.rollout.pipeline_parallel_size,
        "rollout.max_new_tokens": s.rollout.max_new_tokens,
        "cluster.nodes": s.cluster.nodes,
        "checkpoint.save_period": s.checkpoint.save_period,
        "checkpoint.keep_top_k": s.checkpoint.keep_top_k,
        "logging.train_data_log_every": s.logging.train_data_log_every,
    }
    for key, value in sizes.items():
        if value < 1:
            yield V("positive_sizes", key, f"must be ≥ 1, got {value}", f"set {key} to a positive integer"
                    + (" (to score a checkpoint without training: python launch.py eval RUN_DIR|MODEL_DIR)"
                       if key == "grpo.max_steps" else ""))
    if s.cluster.gpus_per_node < 0:
        yield V("positive_sizes", "cluster.gpus_per_node", "must be ≥ 0", "0 for CPU, else GPUs per node")
    if s.train.logprob_chunk_tokens < 0:
        yield V("positive_sizes", "train.logprob_chunk_tokens", f"must be ≥ 0, got {s.train.logprob_chunk_tokens}",
                "set a chunk of tokens (e.g. 4096), or 0 for whole logits")
    if s.cluster.gpus_per_node == 0 and s.cluster.cpu_workers_per_node < 1:
        yield V("positive_sizes", "cluster.cpu_workers_per_node", "a CPU run needs ≥ 1 worker slot per node",
                "set cluster.cpu_workers_per_node=1")
    if s.cluster.cpus_per_worker < 0 or (s.cluster.cpus_per_worker == 0 and s.cluster.kind != ClusterKind.local):
        yield V("positive_sizes", "cluster.cpus_per_worker", f"must be > 0 (0, the machine's cores shared out, "
                f"is for cluster=local only), got {s.cluster.cpus_per_worker}", "set cluster.cpus_per_worker=1")
    if s.grpo.val_period < 0:
        yield V("positive_sizes", "grpo.val_period", "must be ≥ 0 (0 = no periodic validation)",
                "set grpo.val_period=0 or a positive step count")
    if not 0 <= s.logging.profile_step <= max(s.grpo.max_steps, 0):  # (a negative max_steps is its own error)
        yield V("positive_sizes", "logging.profile_step", f"must be 0 (off) or a step ≤ grpo.max_steps "
                f"({s.grpo.max_steps}), got {s.logging.profile_step}", "set logging.profile_step=0 or e.g. 2")


@rule("pure")
def value_ranges(s: RunSpec) -> Iterator[Violation]:
    """Scalars that have a range of their own and no other rule: each refused here, before anything starts."""
    m, e, c, d = s.model, s.env, s.cluster, s.deadlines
    checks = [  # key, value, ok, what it must be (a note on a value after it, in parentheses: "≥ 0 (0 = ...)")
        *((f"model.{k}", getattr(m, k), getattr(m, k) >= 1, "≥ 1") for k in
          ("num_layers", "hidden_size", "ffn_hidden_size", "vocab_size", "max_position_embeddings")),
        ("model.warm_start_steps", m.warm_start_steps, m.warm_start_steps >= 0, "≥ 0 (0 = random weights)"),
        ("env.max_prompt_tokens", e.max_prompt_tokens, e.max_prompt_tokens >= 0, "≥ 0 (0 = counted from the files)"),
        ("env.num_val_prompts", e.num_val_prompts, e.num_val_prompts >= 0, "≥ 0"),
        ("rollout.gpu_memory_utilization", s.rollout.gpu_memory_utilization,
         0 < s.rollout.gpu_memory_utilization <= 1, "in (0, 1]"),
        ("rollout.kv_cache_memory_mb", s.rollout.kv_cache_memory_mb,
         s.rollout.kv_cache_memory_mb is None or s.rollout.kv_cache_memory_mb >= 0, "≥ 0 or null"),
        ("cluster.signal_before_s", c.signal_before_s, c.signal_before_s >= 0, "≥ 0 (0 = no save signal)"),
        ("cluster.ray_join_timeout_s", c.ray_join_timeout_s, c.ray_join_timeout_s >= 1, "≥ 1"),
        ("deadlines.factor", d.factor, d.factor > 0, "> 0"),
        ("deadlines.floor_s", d.floor_s, d.floor_s >= 0, "≥ 0"),
        ("deadlines.first_s", d.first_s, d.first_s > 0, "> 0"),
        ("deadlines.window", d.window, d.window >= 1, "≥ 1"),
        ("deadlines.stop_grace_s", d.stop_grace_s, d.stop_grace_s >= 0, "≥ 0"),
    ]
    for key, value, ok, what in checks:
        if not ok:
            yield V("value_ranges", key, f"must be {what}, got {value}", f"set {key} to a value {what}")
    if m.path is None and 1 <= m.vocab_size < TOKENIZER_SIZE:  # was built with 259 silently, spec.yaml saying 100
        yield V("value_ranges", "model.vocab_size", f"must be ≥ {TOKENIZER_SIZE} for the built-in model, got "
                f"{m.vocab_size}: its byte-level tokenizer has {TOKENIZER_SIZE} tokens",
                f"set model.vocab_size ≥ {TOKENIZER_SIZE} (or model.path=DIR for a model of your own)")
    if e.name == "toy" and e.num_val_prompts > MAX_VAL_PROMPTS:  # the toy task has 10,000 strings in all
        yield V("value_ranges", "env.num_val_prompts", f"must be ≤ {MAX_VAL_PROMPTS} for env=toy, got "
                f"{e.num_val_prompts}: its held-out set leaves at least half of the task's {SPACE} digit strings to "
                "train on", f"set env.num_val_prompts ≤ {MAX_VAL_PROMPTS}")
    validates = s.grpo.val_period > 0 or s.grpo.val_at_start or s.grpo.val_at_end
    if validates and e.name == "toy" and e.num_val_prompts == 0:  # the env that draws its held-out set
        yield V("value_ranges", ("env.num_val_prompts", "grpo.val_period", "grpo.val_at_end"),
                "validation runs on a held-out set of 0 prompts", "set env.num_val_prompts ≥ 1, or "
                "grpo.val_period=0 grpo.val_at_start=false grpo.val_at_end=false (no validation)")


@rule("pure")
def group_size_at_least_two(s: RunSpec) -> Iterator[Violation]:
    g = s.grpo.num_generations_per_prompt
    if g < 2:
        yield V("group_size_at_least_two", "grpo.num_generations_per_prompt",
                f"GRPO needs ≥ 2 samples per prompt for a group baseline, got {g}",
                "set grpo.num_generations_per_prompt ≥ 2 (4-16 is usual)")


@rule("pure")
def train_parallel_divides_world(s: RunSpec) -> Iterator[Violation]:
    world, mp = train_devices(s), train_model_parallel(s)  # = world_size unless cluster.rollout_devices
    if mp > 0 and world % mp:
        t = s.train
        yield V("train_parallel_divides_world",
                ("train.tensor_parallel_size", "train.pipeline_parallel_size", "train.context_parallel_size",
                 "cluster.nodes", "cluster.gpus_per_node"),
                f"TP·PP·CP = {t.tensor_parallel_size}·{t.pipeline_parallel_size}·{t.context_parallel_size} = {mp} "
                f"does not divide the world size {s.cluster.nodes}·{devices_per_node(s)} = {world}",
                f"pick parallel sizes whose product divides {world}, or change the node count")


@rule("pure")
def rollout_parallel_divides_world(s: RunSpec) -> Iterator[Violation]:
    world, mp = engine_devices(s), rollout_model_parallel(s)  # the engines' own devices when separate
    if mp > 0 and world % mp:
        yield V("rollout_parallel_divides_world",
                ("rollout.tensor_parallel_size", "rollout.pipeline_parallel_size", "cluster.gpus_per_node"),
                f"engine TP·PP = {mp} does not divide the {world} devices: "
                f"{world} / {mp} = {world / mp:.2f} engines",
                f"use a rollout.tensor_parallel_size that divides {world}")


@rule("pure")
def rollout_tp_within_node(s: RunSpec) -> Iterator[Violation]:
    per_node, tp = devices_per_node(s), s.rollout.tensor_parallel_size
    if s.rollout.backend == RolloutBackend.vllm and tp > per_node:
        yield V("rollout_tp_within_node", ("rollout.tensor_parallel_size", "cluster.gpus_per_node"),
                f"an engine's TP group ({tp}) must fit on one node ({per_node} devices)",
                f"set rollout.tensor_parallel_size ≤ {per_node}")


@rule("pure")
def rollout_batch_divisible_by_gbs(s: RunSpec) -> Iterator[Violation]:
    p, g, gbs = s.grpo.num_prompts_per_step, s.grpo.num_generations_per_prompt, s.train.global_batch_size
    rollouts = rollouts_per_step(s)
    if gbs > 0 and rollouts % gbs:
        yield V("rollout_batch_divisible_by_gbs",
                ("train.global_batch_size", "grpo.num_prompts_per_step", "grpo.num_generations_per_prompt"),
                f"rollouts per step {p}·{g} = {rollouts} is not a multiple of train.global_batch_size={gbs} "
                f"({rollouts} % {gbs} = {rollouts % gbs}); NeMo-RL finds this at step 1, after a full generation",
                f"set train.global_batch_size to a divisor of {rollouts}, e.g. {rollouts}")


@rule("pure")
def gbs_divisible_by_dp(s: RunSpec) -> Iterator[Violation]:
    mp, world, gbs = train_model_parallel(s), train_devices(s), s.train.global_batch_size
    if mp <= 0 or world % mp:
        return
    dp = dp_size(s)
    if gbs % dp:
        yield V("gbs_divisible_by_dp", ("train.global_batch_size", "cluster.nodes"),
                f"train.global_batch_size={gbs} is not divisible by DP = {world}/{mp} = {dp}",
                f"use a global batch that is a multiple of {dp}")
    elif not s.train.sequence_packing and s.train.micro_batch_size > 0 and (gbs // dp) % s.train.micro_batch_size:
        yield V("gbs_divisible_by_dp", ("train.micro_batch_size", "train.global_batch_size"),
                f"per-rank batch {gbs}/{dp} = {gbs // dp} is not a multiple of "
                f"train.micro_batch_size={s.train.micro_batch_size}",
                f"pick a micro batch that divides {gbs // dp}, or enable train.sequence_packing")


@rule("pure")
def logprob_batch_divides(s: RunSpec) -> Iterator[Violation]:
    mp, world = train_model_parallel(s), train_devices(s)
    if mp <= 0 or world % mp or s.train.sequence_packing or s.train.logprob_batch_size < 1:
        return
    dp, rollouts = dp_size(s), rollouts_per_step(s)
    if rollouts % dp or (rollouts // dp) % s.train.logprob_batch_size:
        yield V("logprob_batch_divides", ("train.logprob_batch_size", "grpo.num_prompts_per_step"),
                f"rollouts per DP rank {rollouts}/{dp} must be a whole multiple of "
                f"train.logprob_batch_size={s.train.logprob_batch_size}",
                "make the rollouts per step a multiple of DP × logprob_batch_size")


@rule("pure")
def expert_parallelism(s: RunSpec) -> Iterator[Violation]:
    t, m = s.train, s.model
    ep, etp, pp = t.expert_parallel_size, t.expert_tensor_parallel_size, t.pipeline_parallel_size
    if ep * etp == 1:
        return
    if m.num_experts == 0:
        yield V("expert_parallelism", ("train.expert_parallel_size", "model.num_experts"),
                f"expert parallelism {ep}×{etp} on a dense model ({m.name})", "set train.expert_parallel_size=1")
        return
    if m.num_experts % ep:
        yield V("expert_parallelism", ("train.expert_parallel_size", "model.num_experts"),
                f"{m.num_experts} experts cannot be split over EP={ep} ({m.num_experts} % {ep} ≠ 0)",
                f"use an EP that divides {m.num_experts}")
    world = train_devices(s)
    if pp > 0 and (world % pp or (world // pp) % (ep * etp)):
        yield V("expert_parallelism", ("train.expert_parallel_size", "train.expert_tensor_parallel_size"),
                f"(world/PP) = {world}/{pp} must be a multiple of EP·ETP = {ep}·{etp} = {ep * etp}",
                "choose EP·ETP dividing the devices of one pipeline stage")


@rule("pure")
def tp4_logprob_batch_matches_micro_batch(s: RunSpec) -> Iterator[Violation]:
    """NeMo-RL's check 13: with TP ≥ 4, logprobs of the same tokens differ between batch sizes (reduction order),
    so the 'old' logprobs (logprob batch) and the update's (micro batch) disagree on-policy."""
    t = s.train
    if t.tensor_parallel_size >= 4 and t.micro_batch_size != t.logprob_batch_size:
        yield V("tp4_logprob_batch_matches_micro_batch",
                ("train.logprob_batch_size", "train.micro_batch_size", "train.tensor_parallel_size"),
                f"TP={t.tensor_parallel_size} ≥ 4 with train.micro_batch_size={t.micro_batch_size} ≠ "
                f"train.logprob_batch_size={t.logprob_batch_size}: the on-policy ratio is not 1",
                f"set train.logprob_batch_size={t.micro_batch_size}")


# head widths vLLM's CPU attention runs (vLLM 0.32 v1/attention/backends/cpu_attn.py get_supported_head_sizes)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@rule("pure")
def heads_divide(s: RunSpec) -> Iterator[Violation]:
    m = s.model
    if m.head_dim is not None and m.head_dim < 1:
        yield V("heads_divide", ("model.head_dim",), f"must be ≥ 1, got {m.head_dim}",
                "set model.head_dim to the attention head width, or null (hidden_size / num_attention_heads)")
        return
    # an explicit head_dim (config.json's) is the head width itself: hidden_size need not split over the heads
    if m.num_attention_heads < 1 or m.num_kv_heads < 1 or (m.head_dim is None and m.hidden_size % m.num_attention_heads):
        yield V("heads_divide", ("model.hidden_size", "model.num_attention_heads"),
                f"hidden {m.hidden_size} must split evenly over {m.num_attention_heads} heads", "fix the model shape")
        return
    if m.num_attention_heads % m.num_kv_heads:
        yield V("heads_divide", ("model.num_kv_heads",),
                f"{m.num_attention_heads} query heads are not a multiple of {m.num_kv_heads} KV heads", "fix the model shape")
    for section, tp in (("train", s.train.tensor_parallel_size), ("rollout", s.rollout.tensor_parallel_size)):
        if m.num_attention_heads % tp:
            yield V("heads_divide", (f"{section}.tensor_parallel_size", "model.num_attention_heads"),
                    f"{m.num_attention_heads} attention heads cannot be split over TP={tp}",
                    f"use a {section}.tensor_parallel_size dividing {m.num_attention_heads}")
    if s.rollout.backend == RolloutBackend.vllm:
        yield from _vllm_ignores_head_dim(s)
        yield from _vllm_transformers_backend(s)
    if s.rollout.backend == RolloutBackend.vllm and s.cluster.gpus_per_node == 0:
        yield from _vllm_cpu_head_dim(s)


# families whose vLLM model class (0.32: qwen2.py, qwen2_moe.py) builds attention of hidden_size / heads, ignoring
# config.json's head_dim that transformers' reads (getattr(config, "head_dim", hidden // heads))
VLLM_IGNORES_HEAD_DIM = ("qwen2", "qwen2_moe")


def _vllm_ignores_head_dim(s: RunSpec) -> Iterator[Violation]:
    """A qwen2 checkpoint with head_dim ≠ hidden / heads: vLLM's engine is built narrower than the policy (at
    3ae9508 its CPU build crashed at the first rollout, 'Unsupported CPU attention configuration: head_dim=16')."""
    m = s.model
    derived = m.hidden_size // max(m.num_attention_heads, 1)
    if m.family in VLLM_IGNORES_HEAD_DIM and m.head_dim and m.head_dim != derived:
        yield V("heads_divide", ("rollout.backend", "model.path" if m.path else "model.head_dim"),
                f"vLLM's {m.family} model ignores head_dim={m.head_dim} and builds heads of hidden_size / "
                f"num_attention_heads = {derived}: its attention would not be the policy's",
                "use rollout=hf (transformers reads head_dim)")


# families vLLM 0.32 runs through its Transformers backend whose refit does not reproduce the policy
# (benchmarks/results/families.md): phi's lm_head bias is dropped (the first refit crashes), gpt_neox's engine
# logprobs stay 0.95 nats off the policy's. olmo2 and starcoder2 (same backend) refit exactly.
VLLM_TRANSFORMERS_BACKEND = ("phi", "gpt_neox")
# families whose vLLM 0.32 model's in-place refit loads none of some layers' weights (layerwise reload: "<layer>:
# Failed to load weights"), which keep the engine's start-up dummy values: rc 0, rollouts off the policy
VLLM_REFIT_UNLOADED = {"gpt_oss": "OAIAttention (its attention sinks) and GptOssRoutedExperts: the tiny gpt_oss's "
                                  "rollouts sat 0.58 nats off the policy",
                       "bloom": "its ParallelLMHead, tied to the embedding (bloom.py prefixes every name with "
                                "'transformer.': the lm_head.weight alias stops the first refit, 'no module or "
                                "parameter named lm_head', and without it the head keeps its dummy weights, 1.11 nats "
                                "off the policy)"}
# families vLLM 0.32 runs as another model than transformers' (the tiny model's rollouts vs the policy, not diagnosed)
VLLM_OFF_POLICY = {"phimoe": "its PhiMoE rollouts sat 0.79-0.83 nats off the policy (the tiny phimoe with and "
                             "without attention/lm_head biases); a config saved by transformers 5 (architectures "
                             "PhimoeForCausalLM) goes to vLLM's Transformers backend, whose first rollout stops at "
                             "'too many values to unpack' in the router"}


def _vllm_transformers_backend(s: RunSpec) -> Iterator[Violation]:
    m = s.model
    if m.family in VLLM_REFIT_UNLOADED:
        yield V("heads_divide", ("rollout.backend", "model.path" if m.path else "model.family"),
                f"vLLM's refit of {m.family} loads no weights into {VLLM_REFIT_UNLOADED[m.family]}",
                "use rollout=hf for this model family")
    if m.family in VLLM_OFF_POLICY:
        yield V("heads_divide", ("rollout.backend", "model.path" if m.path else "model.family"),
                f"vLLM does not run {m.family} as transformers does: {VLLM_OFF_POLICY[m.family]}",
                "use rollout=hf for this model family")
    if m.family in VLLM_TRANSFORMERS_BACKEND:
        yield V("heads_divide", ("rollout.backend", "model.path" if m.path else "model.family"),
                f"vLLM runs {m.family} through its Transformers backend, whose refit does not reproduce the policy "
                "(phi: lm_head bias dropped, the first refit crashes; gpt_neox: rollouts 0.95 nats off the policy)",
                "use rollout=hf for this model family")


def _vllm_cpu_head_dim(s: RunSpec) -> Iterator[Violation]:
    """vLLM's CPU build refuses a head width it has no kernel for; a checkpoint's own width is not the user's to
    change: the fix is the engine (rollout=hf, or vLLM on GPUs), the tiny model's is its shape."""
    m, f = s.model, model_facts(s.model)
    if f.head_dim in VLLM_CPU_HEAD_DIMS:
        return
    got = f"head_dim {f.head_dim} (" + (f"{s.model.path}/config.json" if m.path else " / ".join(f.head_dim_keys)) + ")"
    why = f"vLLM's CPU attention runs head_dim {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}; this model has {got}"
    if m.path:
        yield V("heads_divide", ("rollout.backend", "cluster.gpus_per_node", "model.path"), why,
                "the model is valid, vLLM's CPU build cannot run it: use rollout=hf, or vLLM on GPUs "
                "(cluster.gpus_per_node > 0)")
    else:
        yield V("heads_divide", (*f.head_dim_keys, "rollout.backend"), why,
                "use rollout=hf, or give the tiny model a head width from that list (e.g. model.hidden_size="
                f"{32 * m.num_attention_heads} for {m.num_attention_heads} heads)")


# ---------------------------------------------------------------- lengths --------------------


@rule("pure")
def sequence_lengths(s: RunSpec) -> Iterator[Violation]:
    prompt, new, total = s.env.max_prompt_tokens, s.rollout.max_new_tokens, s.train.max_total_sequence_length
    pos = s.model.max_position_embeddings
    if prompt + new > pos:  # no total fits both: the budget itself is the fix (was "total ≥ 1209" and "≤ 1024")
        yield V("sequence_lengths", ("env.max_prompt_tokens", "rollout.max_new_tokens", "model.max_position_embeddings"),
                f"prompt {prompt} + generation {new} = {prompt + new} exceed the model's {pos} positions",
                f"lower env.max_prompt_tokens and/or rollout.max_new_tokens to a sum ≤ {pos} (longer prompts are "
                "then refused by the data check: shorten or drop them), or use a model with more positions")
    elif prompt + new > total:
        yield V("sequence_lengths",
                ("rollout.max_new_tokens", "env.max_prompt_tokens", "train.max_total_sequence_length"),
                f"prompt {prompt} + generation {new} = {prompt + new} > train.max_total_sequence_length={total}",
                f"lower rollout.max_new_tokens to ≤ {total - prompt}, or raise the total" if total - prompt >= 1 else
                f"set train.max_total_sequence_length ≥ {prompt + new}, or lower env.max_prompt_tokens below {total}")
    mml = s.rollout.max_model_len
    if mml is not None and mml < prompt + new:
        yield V("sequence_lengths", ("rollout.max_model_len",),
                f"the engine's max_model_len {mml} < prompt {prompt} + generation {new} = {prompt + new}",
                f"set rollout.max_model_len ≥ {prompt + new} (or null to derive it)")
    if mml is not None and s.rollout.backend == RolloutBackend.vllm and mml < total:
        yield V("sequence_lengths", ("rollout.max_model_len", "train.max_total_sequence_length"),
                f"the engine's max_model_len {mml} < train.max_total_sequence_length={total}: the engine refuses "
                "sequences that training accepts", f"set rollout.max_model_len ≥ {total}, or null (derived)")
    if pos < total:
        yield V("sequence_lengths", ("train.max_total_sequence_length", "model.max_position_embeddings"),
                f"{total} tokens exceed the model's {s.model.max_position_embeddings} positions",
                f"set train.max_total_sequence_length ≤ {s.model.max_position_embeddings}")
