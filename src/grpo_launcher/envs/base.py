"""The environment interface: prompts for a step, a held-out validation set, and a scorer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Prompt:
    text: Any  # a string, or a list of chat messages [{"role": ..., "content": ...}]
    answer: str
    agent_ref: str  # which agent/task produced the sample (the seed's per-sample field)
    row: dict = field(default_factory=dict, compare=False)  # the dataset row (its columns go to reward fns)
    source: str = ""  # where the row came from: "path/train.jsonl:12" (named in errors)


class Env(Protocol):
    def train_prompts(self, step: int, round_: int, n: int) -> list[Prompt]:
        """n prompts for a step; the same (step, round_) always gives the same prompts (resume-safe)."""

    def val_prompts(self) -> list[Prompt]:
        """The held-out validation set (never drawn for training)."""

    def score(self, prompt: Prompt, completion: str) -> float:
        """Reward in [0, 1]."""

    def warmup_examples(self, n: int) -> list[tuple[str, str]]:
        """(prompt, answer) pairs for the tiny model's supervised warm start; [] if the env has none."""
