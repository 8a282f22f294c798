"""Verifiable math: JSONL rows {"question": ..., "answer": ...}; reward 1 when the last number matches."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from ..spec.schema import EnvSpec
from .base import Prompt

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def load_jsonl(path: str) -> list[Prompt]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [Prompt(text=r["question"], answer=str(r["answer"]), agent_ref="math") for r in rows]


class MathEnv:
    def __init__(self, spec: EnvSpec, seed: int = 0):
        if not spec.train_path or not spec.val_path:
            raise ValueError("env=math needs env.train_path and env.val_path (JSONL)")
        self.seed = seed
        self._train, self._val = load_jsonl(spec.train_path), load_jsonl(spec.val_path)

    def train_prompts(self, step: int, round_: int, n: int) -> list[Prompt]:
        rng = random.Random(f"train-{self.seed}-{step}-{round_}")
        return [rng.choice(self._train) for _ in range(n)]

    def val_prompts(self) -> list[Prompt]:
        return list(self._val)

    def score(self, prompt: Prompt, completion: str) -> float:
        found = NUMBER.findall(completion)
        return 1.0 if found and float(found[-1]) == float(prompt.answer) else 0.0

    def warmup_examples(self, n: int) -> list[tuple[str, str]]:
        rng = random.Random(f"warmup-{self.seed}")
        return [(p.text, p.answer) for p in (rng.choice(self._train) for _ in range(n))]
