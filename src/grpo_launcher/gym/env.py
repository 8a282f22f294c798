"""env=nemo_gym's Env: Gym JSONL rows (env.train_path / env.val_path), drawn per step like the other envs.

A row is Gym's dataset row (`responses_create_params`, `agent_ref`, task fields such as `expected_answer`);
it goes to its agent as is. Rewards come from Gym's resources servers (through the agent's `/run`), so
`score` is not used: GymSource (train/gym_loop.py) takes each rollout's reward from its result.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

import jinja2

from ..envs.base import first_position
from .samples import GymPrompt
from .serving import CHATML

DATA = Path(__file__).parent / "data"


def load_rows(path: Optional[str]) -> list[dict]:
    if not path:
        return []
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON line ({exc})") from exc
                if not isinstance(row, dict) or "responses_create_params" not in row:
                    raise ValueError(f"{path}:{n}: a Gym row needs responses_create_params")
                rows.append(row)
    return rows


def prompt_text(row: dict) -> str:
    """The row's last user message, for logs (the agent gets the whole row)."""
    inp = (row.get("responses_create_params") or {}).get("input")
    if isinstance(inp, str):
        return inp
    for msg in reversed(inp or []):
        if isinstance(msg, dict) and msg.get("role") == "user":
            c = msg.get("content")
            if isinstance(c, list):
                return " ".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
            return str(c)
    return ""


def to_prompt(row: dict, index: int) -> GymPrompt:
    ref = row.get("agent_ref") or {}
    return GymPrompt(text=prompt_text(row), answer=str(row.get("expected_answer", "")),
                     agent_ref=str(ref.get("name", "")) if isinstance(ref, dict) else str(ref), row=row, index=index)


class GymEnv:
    """env.name=nemo_gym in the env registry (envs.LAZY_ENVS); its loop's rollout source is GymSource."""

    data_origin: tuple[int, int] = (0, 0)  # set by the trainer on a resume (envs/base.py first_position)

    @staticmethod
    def rollout_source() -> type:
        """The loop's rollout source for this env: Gym's servers around it, rollouts and rewards through its agents."""
        from ..train.gym_loop import GymSource  # imports train/: not at module import (the registry imports us)

        return GymSource

    def __init__(self, spec, seed: int = 0):
        self.spec, self.seed = spec, seed
        self.train = [to_prompt(r, i) for i, r in enumerate(load_rows(spec.train_path))]
        self.val = [to_prompt(r, i) for i, r in enumerate(load_rows(spec.val_path))]
        if not self.train:
            raise ValueError(f"env.train_path={spec.train_path!r}: no Gym rows")

    def train_prompts(self, step: int, round_: int, n: int) -> list[GymPrompt]:
        """Epochs of a seeded shuffle; (step, round_) picks the same rows on every resume."""
        start = first_position(self.data_origin, step, n) + round_ * 7919 * n  # rounds > 0 (dynamic sampling)
        # draw elsewhere in the stream
        out = []
        for k in range(start, start + n):
            epoch, pos = divmod(k, len(self.train))
            order = list(range(len(self.train)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            out.append(self.train[order[pos]])
        return out

    def val_prompts(self) -> list[GymPrompt]:
        return list(self.val)

    def score(self, prompt, completion: str) -> float:  # noqa: ARG002
        raise RuntimeError("env=nemo_gym is scored by Gym's resources servers, not by the driver")

    def warmup_examples(self, n: int) -> list[tuple[str, str]]:
        """The tiny model's warm start (model.path=null only): the shipped tiny rows' formats, rendered with the
        chat template the server uses, so the model starts near Gym's rewards: `\\boxed{a+b}` for math rows
        (right about as often as not: the rewards vary within a group), a pythonic `get_weather` call for
        tool rows (so the agent runs a tool and a second turn: the multi-turn path is exercised for real)."""
        rng = random.Random(self.seed)
        out = []
        for _ in range(n):
            if rng.random() < 0.5:
                a, b = rng.randint(1, 9), rng.randint(1, 9)
                msgs = [{"role": "user", "content": f"What is {a}+{b}? Answer in \\boxed{{}}."}]
                answer = f"\\boxed{{{a + b + rng.choice([0, 0, 1, -1])}}}"
            else:
                city = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 5)))
                msgs = [{"role": "user", "content": f"weather in {city}?"}]
                answer = f'[get_weather(city="{city}")]'
            out.append((render_chat(msgs), answer))
        return out


def render_chat(messages: list[dict]) -> str:
    """data/chatml.jinja as vLLM renders it (the template the tiny model's server gets)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHATML.read_text()).render(messages=messages, add_generation_prompt=True)
