"""env=math: verifiable math from JSONL rows {"question": ..., "answer": ...} (env.prompt_key / answer_key);
reward 1 when the last number of the completion equals the answer. A DatasetEnv with a default reward."""

from __future__ import annotations

from .dataset import DatasetEnv
from .rewards import NUMBER  # noqa: F401  (kept importable from here)


class MathEnv(DatasetEnv):
    DEFAULT_REWARD = "grpo_launcher.envs.rewards:last_number_match"
