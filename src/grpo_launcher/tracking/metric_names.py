"""The names of the metrics a run logs (MLflow, the per-step line, summary.json): one list.

The driver (train/driver.py) and the policy workers produce them; checkpoint.metric (preflight/training.py), the
Optuna objective (hydra.sweeper.objective, checked at the sweep's pre-flight: launch/sweep.py) and the
curve (tracking/plot.py) name them. tests/integration/test_sweeps.py checks a real run's summary.json against this list.
"""

from __future__ import annotations

# per step: rollout and scoring (train/driver.py make_batch, step)
TRAIN_REWARD_MEAN = "train/reward_mean"  # every sample the step generated (loss=dapo: kept groups or not)
TRAIN_REWARD_STD = "train/reward_std"
TRAIN_ACCURACY = "train/accuracy"  # the share of samples whose (weighted) reward is ≥ 1: exact for 0/1 rewards
TRAIN_ADV_MEAN = "train/adv_mean"
TRAIN_ADV_STD = "train/adv_std"
TRAIN_ADV_ABS_MAX = "train/adv_abs_max"
TRAIN_GEN_LEN_MEAN = "train/gen_len_mean"
TRAIN_TRUNCATION_RATE = "train/truncation_rate"
TRAIN_DYNAMIC_SAMPLING_ROUNDS = "train/dynamic_sampling_rounds"
TRAIN_TOKENS_PER_S = "train/tokens_per_s"
# env=dataset / math (envs/rewards.py reward_metrics): samples whose reward function failed (env.reward_errors=zero),
# and each reward function's mean, train/reward/<name>_mean and val/reward/<name>_mean (REWARD_PART_PREFIXES)
TRAIN_REWARD_ERRORS = "train/reward_errors"
VAL_REWARD_ERRORS = "val/reward_errors"
REWARD_PART_PREFIXES = ("train/reward/", "val/reward/")
# per step: the policy update (algos.policy_loss's metrics, combined over micro-batches and ranks: TRAIN_PREFIX + name)
TRAIN_PREFIX = "train/"
TRAIN_LOSS = "train/loss"
TRAIN_PG_LOSS = "train/pg_loss"
TRAIN_KL = "train/kl"
TRAIN_CLIP_FRACTION = "train/clip_fraction"
TRAIN_RATIO_MEAN = "train/ratio_mean"
TRAIN_RATIO_MAX = "train/ratio_max"
TRAIN_ENTROPY = "train/entropy"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_LR = "train/lr"
TRAIN_SKIPPED_OPTIMIZER_STEPS = "train/skipped_optimizer_steps"  # minibatches with nothing to learn: no step
TRAIN_OPTIMIZER_STEPS = "train/optimizer_steps"  # optimizer steps this step took (0: no update; the step line says why)
TRAIN_EQUAL_REWARD_GROUPS = "train/equal_reward_groups"  # groups whose rewards were all equal: advantage 0
TRAIN_LOGPROBS_FROM_UPDATE = "train/logprobs_from_update"
TRAIN_GEN_VS_POLICY_LOGPROB_ABSDIFF = "train/gen_vs_policy_logprob_absdiff"
# per step: the rollout pipeline, the same keys in sync and async GRPO (train/async_loop.py)
TRAIN_POLICY_VERSION = "train/policy_version"
BUFFER_DEPTH = "buffer/depth"
BUFFER_SAMPLE_AGE_MEAN = "buffer/sample_age_mean"
BUFFER_SAMPLE_AGE_MAX = "buffer/sample_age_max"
# validation (every grpo.val_period steps)
VAL_REWARD_MEAN = "val/reward_mean"
VAL_ACCURACY = "val/accuracy"  # (as train/accuracy)
VAL_SAMPLES = "val/samples"
# env=nemo_gym (train/gym_loop.py)
GYM_FAILED_ROLLOUTS = "gym/failed_rollouts"
GYM_NON_CONTIGUOUS_SAMPLES = "gym/non_contiguous_samples"
GYM_ENV_MASKED_SAMPLES = "gym/env_masked_samples"
GYM_TURNS_MEAN = "gym/turns_mean"
GYM_MULTI_TURN_SAMPLES = "gym/multi_turn_samples"
GYM_TRAINABLE_SAMPLES = "gym/trainable_samples"
ROLLOUT_ENGINE_RESTARTS = "rollout/engine_restarts"  # engines restarted in this process (deadlines.engine_restarts)
ROLLOUT_SLEEP_FREED_GIB = "rollout/sleep_freed_gib"  # GPU memory the engines' sleep freed for the update (sum)
# GPU memory per step (GPU runs): the whole-GPU peak of the driver node's GPUs since the last step
# (tracking/gpu_memory.py), the policy's own after its update on its most loaded rank (policy/update_log.py), and
# a sleeping engine's (rollout/vllm.py sleep)
MEMORY_GPU_STEP_PEAK_GIB = "memory/gpu_step_peak_gib"
MEMORY_POLICY_ALLOCATED_GIB = "memory/policy_allocated_gib"
MEMORY_POLICY_RESERVED_GIB = "memory/policy_reserved_gib"
MEMORY_ENGINE_ASLEEP_GIB = "memory/engine_asleep_gib"  # sleep mode: what an engine's torch allocator keeps asleep
# MoE models, per step (policy/update_log.py RouterLoad): the routers' load, over all MoE layers and per layer
# (train/moe/layer_<i>/max_load, train/moe/layer_<i>/entropy)
TRAIN_MOE_PREFIX = "train/moe/"
TRAIN_MOE_MAX_LOAD = "train/moe/max_load"  # the busiest expert's token share / the mean share (1 = balanced)
TRAIN_MOE_ENTROPY = "train/moe/entropy"  # routing entropy / log(experts), mean over layers (1 = uniform)
# wall time: time/<phase>_s per phase of the step (rollout, score, logprobs, update, refit, log), time/step_s
TIME_PREFIX = "time/"
TIME_STEP_S = "time/step_s"
TIME_REFIT_MS = "time/refit_ms"  # the driver's wait for the whole refit
# the refit's parts (train/engines.py refit_parts): the slowest engine's own time for it, every path; over CUDA IPC
# (policy/hybrid.py send_weights_ipc) policy rank 0's waits on the engines' start, per-buffer loads and finish
# (layerwise reload finalized, prefix cache reset) and its own cast + pack + export of the buffers. time/refit_ms
# less those four: the driver <-> policy hop and sleep mode's cache release
TIME_REFIT_ENGINE_MS = "time/refit_engine_ms"
TIME_REFIT_START_MS = "time/refit_start_ms"
TIME_REFIT_PACK_MS = "time/refit_pack_ms"
TIME_REFIT_LOAD_MS = "time/refit_load_ms"
TIME_REFIT_FINISH_MS = "time/refit_finish_ms"
TIME_TRAINER_IDLE_S = "time/trainer_idle_s"
TIME_GENERATION_IDLE_S = "time/generation_idle_s"

METRICS: frozenset[str] = frozenset(v for k, v in dict(globals()).items() if k.isupper() and not k.endswith("_PREFIX")
                                    and isinstance(v, str))


def is_metric(name: str) -> bool:
    """A name a run logs: one of METRICS, or a phase's wall time (time/<phase>_s)."""
    return (name in METRICS or (name.startswith(TIME_PREFIX) and name.endswith("_s"))
            or (name.startswith(REWARD_PART_PREFIXES) and name.endswith("_mean"))
            or (name.startswith(TRAIN_MOE_PREFIX) and name.endswith(("/max_load", "/entropy"))))
