"""The run spec: one frozen dataclass per config section.

Hydra composes `conf/` against these classes (unknown keys and wrong types fail at compose time);
`OmegaConf.to_object` then turns the result into ONE frozen `RunSpec`, which is all the code below
`launch.py` ever sees. Closed choices are `str` Enums (OmegaConf 2.3 has no `Literal` support).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional


class RolloutBackend(str, Enum):
    hf = "hf"
    vllm = "vllm"


class TrainBackend(str, Enum):
    torch = "torch"
    megatron = "megatron"


class ClusterKind(str, Enum):
    local = "local"
    slurm = "slurm"


class EnvName(str, Enum):  # the built-in envs; env.name also takes a user class "module:Class"
    toy = "toy"
    math = "math"
    nemo_gym = "nemo_gym"
    dataset = "dataset"


# env.reward_errors (a functional Enum: `raise` is a keyword): raise = the run stops naming the function and the
# row; zero = the failing function scores 0, failures are counted (train/reward_errors), the first kept
RewardErrors = Enum("RewardErrors", {"raise": "raise", "zero": "zero"}, type=str)


class Precision(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class Advantage(str, Enum):
    group_norm = "group_norm"
    leave_one_out = "leave_one_out"
    leave_one_out_std = "leave_one_out_std"  # / the others' std: NeMo-RL's normalize_rewards + leave-one-out baseline
    no_std = "no_std"


class Aggregation(str, Enum):
    token_mean = "token_mean"
    seq_mean_token_mean = "seq_mean_token_mean"
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"


class RatioLevel(str, Enum):
    token = "token"
    sequence = "sequence"


class KLEstimator(str, Enum):
    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class ISTruncation(str, Enum):
    none = "none"
    tis = "tis"
    icepop = "icepop"


class Resume(str, Enum):
    auto = "auto"  # resume from the latest complete checkpoint of this run, if any
    fresh = "fresh"  # start over: the old checkpoints of this run are moved aside, never deleted


@dataclass(frozen=True)
class ModelSpec:
    """With model.path set, the architecture keys below are read from its config.json at pre-flight (a key
    given explicitly that disagrees with the checkpoint is a config error); these defaults are the tiny model's."""

    name: str = "tiny"  # with model.path and no explicit name: the checkpoint directory's name
    # HF checkpoint directory; null = build the tiny model locally (no hub access needed)
    path: Optional[str] = None
    family: str = "qwen2"  # HF model_type (config.json); the megatron backend maps llama, qwen2, qwen3, qwen3_moe
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    # attention head width (config.json head_dim: Qwen3, Gemma and Mistral set it); null = hidden_size / heads
    head_dim: Optional[int] = None
    ffn_hidden_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    num_experts: int = 0  # 0 = dense
    moe_top_k: int = 0
    tie_word_embeddings: bool = False  # input and output embeddings shared (config.json tie_word_embeddings)
    dtype: Precision = Precision.float32
    # model.path=null: supervised warm-start steps of the locally built model on the env's format (0 = random)
    warm_start_steps: int = 80


@dataclass(frozen=True)
class RolloutSpec:
    backend: RolloutBackend = RolloutBackend.hf
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    async_engine: bool = False
    expose_http_server: bool = False
    http_host: str = "127.0.0.1"  # never 0.0.0.0 unless asked for explicitly
    # the HTTP server's API key: null = a fresh one per run (RUN_DIR/rollout_endpoints.json, 0600); "" = none
    http_api_key: Optional[str] = None
    # sampling temperature (≥ 1e-5: vLLM is greedy below); engines always sample the full distribution (no top_p /
    # top_k): the importance ratios need the logprobs of the distribution the policy trains on
    temperature: float = 1.0
    max_new_tokens: int = 8
    # null = prompt budget + max_new_tokens (derived in the plan)
    max_model_len: Optional[int] = None
    gpu_memory_utilization: float = 0.5
    # the vLLM engine's KV cache per device, MiB; null = derived: on a GPU the rest of the engine's budget
    # (gpu_memory_utilization × the GPU, less its weights and activations), on CPU 64 (never sized from free RAM)
    kv_cache_memory_mb: Optional[int] = None
    enforce_eager: bool = True
    # vLLM's sleep mode for engines colocated with the policy on GPUs: level 2 (weights and KV cache freed) while
    # the logprob and update phases run, woken by the refit (off by default; GPU figures:
    # benchmarks/results/vllm_rollout.md)
    sleep_mode: bool = False
    # rollout=hf on CUDA: static KV cache + torch.compile(reduce-overhead) decoding (CUDA graphs); false = eager
    hf_compile: bool = False  # no gain over eager as wired (benchmarks/results/gpu_step.md);
    # with Liger's kernels on (train.fused_kernels) the compiled decode also skips CUDA graphs (mutated inputs)


@dataclass(frozen=True)
class LossSpec:
    name: str = "grpo"
    advantage: Advantage = Advantage.group_norm
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: Optional[float] = None
    ratio_level: RatioLevel = RatioLevel.token
    aggregation: Aggregation = Aggregation.seq_mean_token_mean
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.k3
    kl_clamp: Optional[float] = None
    importance_sampling_correction: bool = False
    is_truncation: ISTruncation = ISTruncation.none
    # tis: weights above it are capped; icepop: the upper bound of the kept band [is_threshold_low, is_threshold]
    is_threshold: Optional[float] = None
    # icepop's lower bound (IcePop: 0.5); null = 1 / is_threshold
    is_threshold_low: Optional[float] = None
    overlong_filtering: bool = False
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 3  # hard cap on refill generations per step


@dataclass(frozen=True)
class MoESpec:
    freeze_router: bool = False
    router_dtype: Precision = Precision.float32
    load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | sinkhorn | none
    aux_loss_coeff: float = 0.0
    token_dispatcher: str = "alltoall"  # alltoall | allgather | flex (flex needs TE + DeepEP)


@dataclass(frozen=True)
class TrainSpec:
    backend: TrainBackend = TrainBackend.torch
    global_batch_size: int = 128
    # rows per micro-batch of the update (logprob_batch_size: of the logprob pass), each at the minibatch's length;
    # with dynamic_batching: a budget of that many rows of max_total_sequence_length tokens (and of
    # rollout.max_new_tokens response positions) instead
    micro_batch_size: int = 32
    logprob_batch_size: int = 64
    # token-budget micro-batches (policy/microbatch.py, both backends): rows longest first, each micro-batch cut to
    # its own longest row and filled with rows up to the budget above (the shape the memory pre-flight counts). The
    # same loss and gradients as fixed rows up to float summation order: fewer padded tokens on uneven lengths.
    # Off by default: any reordering changes the default CPU run's trajectory (benchmarks/results/step_phases.md)
    dynamic_batching: bool = False
    # the output layer runs over this many tokens at a time and each chunk's logits are reduced to the sampled
    # token's logprob and the entropy at once (algos/linear_logprobs.py; megatron: over the response tokens, its
    # vocab-parallel form for TP > 1): no [tokens, V] logits whole, in the update and the logprob pass. 0 = whole
    # logits (algos.token_logprobs over the model's output)
    logprob_chunk_tokens: int = 4096
    # fused kernels on GPUs (off on CPU). torch backend: Liger's Triton kernels for RMSNorm, SwiGLU and RoPE
    # (policy/fused.py; model.family llama, qwen2, qwen3); null = on where they apply (a GPU, such a family,
    # liger-kernel installed). megatron: megatron-core's own torch.compile'd SwiGLU and residual add (no TE or
    # Apex needed); null = on with a GPU
    fused_kernels: Optional[bool] = None
    lr: float = 3e-4  # linear warm-up over warmup_steps, then constant
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # gradients clipped to this global L2 norm (> 0; both backends)
    precision: Precision = Precision.float32
    max_total_sequence_length: int = 64
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    # sequences end to end in rows of max_total_sequence_length (micro_batch_size then counts rows): the torch
    # backend, dense and MoE attention models (policy/packing.py); refused on megatron and for Mamba layers
    sequence_packing: bool = False
    distributed_optimizer: bool = False
    # torch backend on GPUs: FSDP2's CPUOffloadPolicy (policy/fsdp.py), also on one rank: the fp32 weight shards,
    # gradients and AdamW state live in pinned host RAM, the optimizer step runs on the CPU; the GPU holds the
    # layers being computed, activations and logits
    cpu_offload: bool = False
    # megatron backend: core attention of the local layer spec: sdpa (torch flash/efficient kernels) | local
    core_attention: str = "sdpa"
    # megatron backend: does the run's environment provide Transformer Engine? null = not asserted
    # (pre-flight then skips the TE-only checks; the worker fails at start if a TE-only feature is asked for)
    transformer_engine: Optional[bool] = None
    moe: MoESpec = field(default_factory=MoESpec)


@dataclass(frozen=True)
class AsyncGrpoSpec:
    """Async GRPO (NeMo-RL's key names): engines on devices of their own (cluster.rollout_devices) generate the
    next steps' batches while the trainer updates; train/async_loop.py."""

    enabled: bool = False  # true: generation of steps k+1..k+N overlaps the update of step k
    # N: a sample generated with policy version v is trained on at step k only if (k - 1) - v <= N (≥ 1)
    max_trajectory_age_steps: int = 1
    # true: new weights reach an engine at once. rollout=vllm with rollout.async_engine=true: requests in flight
    # are interrupted and resume on them (per sample: policy_version first, policy_version_last in the data log);
    # rollout=hf / the offline vllm.LLM: applied from the engine's next generate call (calls already queued run on
    # them; a call in flight finishes on its weights). false: they queue behind the calls already submitted.
    in_flight_weight_updates: bool = False


@dataclass(frozen=True)
class GrpoSpec:
    num_prompts_per_step: int = 16
    num_generations_per_prompt: int = 8
    max_steps: int = 150
    val_period: int = 10
    val_at_start: bool = False
    val_at_end: bool = True
    val_batch_size: int = 64
    # null = the whole validation set
    max_val_samples: Optional[int] = None
    seed: int = 0
    async_grpo: AsyncGrpoSpec = field(default_factory=AsyncGrpoSpec)


def validation_on(grpo: GrpoSpec) -> bool:
    """Whether the run validates at all (grpo.val_period > 0, val_at_start or val_at_end): without it env.val_path is
    neither required nor read (pre-flight, the prompting record, the data record)."""
    return grpo.val_period > 0 or grpo.val_at_start or grpo.val_at_end


@dataclass(frozen=True)
class EnvSpec:
    # toy | math | dataset | nemo_gym, or a user Env class: "package.module:Class" / "path/to/envs.py:Class"
    name: str = "toy"
    # JSONL, Parquet, or a saved HF `datasets` directory; null = the env's built-in generator
    train_path: Optional[str] = None
    val_path: Optional[str] = None
    num_val_prompts: int = 64  # generated envs: size of the held-out set
    # prompt budget in tokens (chat template included); 0 = the longest prompt of the train and val files, counted at
    # pre-flight (env=dataset's default; spec.yaml records the number)
    max_prompt_tokens: int = 8
    prompt_key: str = "prompt"  # dataset column holding the prompt (a string, or a list of chat messages)
    answer_key: Optional[str] = "answer"  # column with the reference answer; null = rows have none
    shuffle: bool = True  # a new order every epoch (seeded by grpo.seed); false = file order
    # null = as many passes as grpo.max_steps takes; set: pre-flight checks max_steps covers exactly this many
    epochs: Optional[int] = None
    # reward: "package.module:function" or "path/to/rewards.py:function", called as
    # fn(prompt, completion, **row_columns) -> float; null = the env's own scorer
    reward_fn: Optional[str] = None
    reward_fns: list[str] = field(default_factory=list)  # several, summed with reward_weights
    reward_weights: list[float] = field(default_factory=list)  # one per reward function; empty = all 1.0
    # a reward function that raises or returns a non-finite / non-number: raise (stop, naming it and the row) or
    # zero (score 0, count it as train/reward_errors, keep the first traceback in RUN_DIR/reward_errors.txt)
    reward_errors: RewardErrors = RewardErrors["raise"]
    # the tokenizer's chat template around each prompt; null = on when the tokenizer has one
    chat_template: Optional[bool] = None
    # the system message of every prompt without its own (train and val alike; a row's own system message wins)
    system_prompt: Optional[str] = None
    # NeMo Gym resource servers (config files the Gym side reads)
    gym_config_paths: list[str] = field(default_factory=list)
    # env=nemo_gym (grpo_launcher/gym): Gym config overrides "dotted.key=value" (value read as YAML), e.g.
    # math_with_judge.resources_servers.math_with_judge.should_use_judge=false
    gym_overrides: list[str] = field(default_factory=list)
    gym_tool_call_parser: Optional[str] = None  # the policy server's --tool-call-parser for tool envs (pythonic, ...)
    gym_start_timeout_s: float = 600.0  # Gym's servers and its model-endpoint check must be up within this


@dataclass(frozen=True)
class ClusterSpec:
    kind: ClusterKind = ClusterKind.local
    nodes: int = 1
    gpus_per_node: int = 0  # 0 = CPU-only run
    cpu_workers_per_node: int = 1  # CPU runs: worker slots per node (a slot stands in for a GPU)
    cpus_per_worker: float = 1.0  # CPU runs: cores per worker slot; 0 (cluster=local) = the cores shared out
    # devices (GPUs; CPU worker slots on a CPU run) of the job's total given to rollout engines alone, after the
    # policy's (non-colocated: needed by grpo.async_grpo); 0 = the engines share the policy's devices (colocated)
    rollout_devices: int = 0
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = "01:00:00"  # Slurm --time: [D-]HH:MM:SS
    job_name: Optional[str] = None
    exclusive: bool = False
    requires_account: bool = False  # set by cluster profiles whose Slurm insists on --account
    requires_partition: bool = False
    container_image: Optional[str] = None
    container_mounts: list[str] = field(default_factory=list)
    env_passthrough: list[str] = field(default_factory=list)  # names only, never values
    # interpreter on the compute nodes (its ray CLI too); null = the one running launch.py
    python: Optional[str] = None
    # true: launch although vLLM/torch/transformers/megatron-core/Ray lie outside the tested ranges (spec/versions.py)
    untested_versions: bool = False
    # cluster=ray: an existing Ray cluster's GCS address HOST:PORT (conf/cluster/ray.yaml takes $RAY_ADDRESS); the
    # driver runs here, joins it with its auth (RAY_AUTH_MODE=token where a token is found), never starts or stops
    # it; "" = cluster=ray without an address (refused); null = start a Ray here (cluster=local) or the job's own
    ray_address: Optional[str] = None
    ray_port: int = 6379  # first port of the fixed Ray port block (see launch/sbatch.py)
    ray_temp_dir: str = "/tmp/ray"  # short: AF_UNIX socket paths are capped at 107 bytes
    ray_join_timeout_s: int = 300
    signal_before_s: int = 120  # ask Slurm for SIGUSR1 this long before --time
    requeue: bool = True
    object_store_memory_mb: int = 256
    # >0 only where several "nodes" share one host (the local test cluster): shifts each node's Ray ports
    node_port_stride: int = 0
    # >0 only where several JOBS share hosts (an oversubscribed test cluster, concurrent sweep points):
    # job J's whole port block is shifted by (J % 16) × this
    job_port_stride: int = 0
    wait: bool = False  # slurm: block until the job ends, streaming the driver log
    node_gpus: Optional[int] = None  # GPUs a node of this cluster has (set by its profile); null = unknown
    # memory of one GPU in GiB as torch reports it (set by the profile; figures per GPU model:
    # benchmarks/results/environments.md); null = unknown: the memory pre-flight (preflight/memory_*.py) then prints
    # its estimate but skips the check, with a warning
    gpu_memory_gib: Optional[float] = None


@dataclass(frozen=True)
class CheckpointSpec:
    enabled: bool = True
    save_period: int = 10
    keep_top_k: int = 2
    metric: str = "val/reward_mean"
    higher_is_better: bool = True
    resume: Resume = Resume.auto
    # wall time after which a checkpoint is saved and the job stops ([D-]HH:MM:SS); null = off
    must_save_by: Optional[str] = None


@dataclass(frozen=True)
class LoggingSpec:
    mlflow: bool = True
    # also TensorBoard event files in RUN_DIR/tensorboard/: the same metric names, steps and resume continuity
    tensorboard: bool = False
    wandb: bool = False  # also W&B (offline in RUN_DIR/wandb/ unless WANDB_MODE/WANDB_API_KEY say otherwise)
    tracking_uri: Optional[str] = None  # null = sqlite store in the output root
    experiment: str = "grpo"
    train_data_log: bool = False  # one JSON line per sample, every `train_data_log_every` steps
    train_data_log_every: int = 1
    progress: bool = True
    profile_step: int = 0  # N > 0: step N of every policy worker under torch.profiler (RUN_DIR/profile/)


@dataclass(frozen=True)
class DeadlinesSpec:
    """How long the driver waits for another process (a policy rank, a rollout engine, the env worker) before it
    calls the run hung (deadlines.py). Each phase (generate, score, logprobs, update, refit, save, ...) may
    wait max(factor × its slowest of the last `window` waits, floor_s); its first wait in a driver process (no
    history yet: model load, warm-up, compilation) first_s. A passed deadline ends the run with exit code 4
    (ExitCode.HUNG), status HUNG, and a message naming the phase, the stuck actor and its stack."""

    enabled: bool = True  # false: the driver waits for its actors without a deadline (as before)
    factor: float = 5.0  # k: a phase may take k × its slowest recent wait
    floor_s: float = 300.0  # no phase deadline below this
    # a phase's first wait (no history yet); also the policy ranks' gloo/NCCL collective timeout
    first_s: float = 1800.0
    window: int = 20  # how many of a phase's most recent waits count
    # the first SIGTERM / SIGINT / SIGUSR1 waits this long for the current step, then abandons it as a second does;
    # also with enabled=false (a stop the user asked for never waits for ever); 0 = it waits for the step
    stop_grace_s: float = 300.0
    # rollout=vllm: every health_period_s each engine answers a probe (off the step's critical path, answered during
    # a generate call) within health_timeout_s, or it is killed; 0 = no probe (a dead engine is still found by the
    # waits). A dead or killed engine is restarted, given the policy's current weights, and its requests retried,
    # at most engine_restarts times per run; the next loss ends the run (exit 4) naming the engine
    health_period_s: float = 10.0
    health_timeout_s: float = 10.0
    engine_restarts: int = 3


@dataclass(frozen=True)
class RunSpec:
    name: str = "tiny-grpo"
    output_root: str = "outputs"
    dry_run: bool = False
    model: ModelSpec = field(default_factory=ModelSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    loss: LossSpec = field(default_factory=LossSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    grpo: GrpoSpec = field(default_factory=GrpoSpec)
    env: EnvSpec = field(default_factory=EnvSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    logging: LoggingSpec = field(default_factory=LoggingSpec)
    deadlines: DeadlinesSpec = field(default_factory=DeadlinesSpec)


# Which section each config group fills (the group name is also the section name).
GROUPS = ("model", "rollout", "loss", "cluster", "env")
