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


def first_position(origin: tuple[int, int], step: int, n: int) -> int:
    """The position in a dataset's stream of step `step`'s first prompt, n prompts a step from `origin` = (a step,
    the prompts drawn through it): (0, 0) on a fresh run, the resumed checkpoint's (train/loop_state.py) on a
    resume. A resume that changed grpo.num_prompts_per_step carries on from the next row (a position of
    (step - 1) × n skipped rows 17-32 of 64 when 4 became 8 at step 5, or trained some twice when it shrank)."""
    s0, c0 = origin
    return c0 + (step - s0 - 1) * n
