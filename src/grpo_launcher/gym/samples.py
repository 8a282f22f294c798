"""A Gym `/run` result → one training sample, with the engine's own token ids (nothing is re-tokenised).

A rollout is a chain of model calls. Each trainable output item of the result's `response.output` carries
the WHOLE prompt of its call (`prompt_token_ids`, chat template included), the call's `generation_token_ids`
and `generation_log_probs`. As NeMo-RL's `_postprocess_nemo_gym_to_nemo_rl_result` does, the sample is

    prompt_ids   = call 1's prompt
    response_ids = gen_1 ++ (prompt_2 - seen) ++ gen_2 ++ ... ++ gen_k
    loss mask    = 1 on every gen_i token, 0 on the tokens Gym put between turns (tool output, user turns)

which is only a valid sequence when each call's prompt extends exactly what came before (`seen`). Stock vLLM
re-renders and re-tokenises the history, so that can fail (shared/reference/nemo-gym.md §6): such a sample
is kept in its group (GRPO's group statistics stay whole) but marked non-contiguous, its loss masked
(sample_loss_mask = 0) and counted, never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..envs.base import Prompt
from ..batch import Generation


@dataclass(frozen=True)
class GymPrompt(Prompt):
    """One Gym JSONL row: Prompt's fields (for logs) plus the row itself (sent to the agent as is)."""

    row: dict = field(default_factory=dict, compare=False, hash=False)
    index: int = 0  # position in its data file


@dataclass(frozen=True)
class GymGeneration(Generation):
    """A Generation whose response may span several turns: `loss_mask` marks the policy's own tokens."""

    loss_mask: tuple = ()  # one 0/1 per response token
    reward: float = 0.0
    agent_ref: str = ""
    turns: int = 0
    contiguous: bool = True
    mask_sample: bool = False  # Gym's "the environment failed, not the policy" flag
    failed: str = ""  # why the rollout could not be used ("" = fine): agent error, no token ids, ...
    break_at: int = -1  # non-contiguous: the first position where a turn's prompt leaves the tokens before it

    @property
    def trainable(self) -> bool:
        return self.contiguous and not self.mask_sample and not self.failed


def token_items(response: dict) -> list[dict]:
    """The output items that carry a model call's token ids, one per call (a call that produced several
    items, e.g. text + a function call, attaches the same ids to each: counted once)."""
    out: list[dict] = []
    for item in (response or {}).get("output") or []:
        if not isinstance(item, dict) or item.get("generation_token_ids") is None:
            continue
        if out and (out[-1]["prompt_token_ids"] == item.get("prompt_token_ids")
                    and out[-1]["generation_token_ids"] == item["generation_token_ids"]):
            continue
        out.append(item)
    return out


def is_truncated(response: dict) -> bool:
    """The last model call hit max_output_tokens (Gym: status incomplete, reason max_output_tokens)."""
    details = (response or {}).get("incomplete_details") or {}
    return (response or {}).get("status") == "incomplete" and details.get("reason") in ("max_output_tokens", "length")


def to_generation(result: dict, row: dict, max_model_len: Optional[int] = None) -> GymGeneration:
    """Map one `/run` result (for `row`) to a GymGeneration. Never raises on bad content: a result that cannot
    be trained on comes back with `failed` set (and an empty response), so its group stays whole."""
    agent = _agent_name(row)
    response = result.get("response") or {}
    items = token_items(response)
    reward = float(result.get("reward") or 0.0)
    if not items:
        return failed_generation(row, "no token ids in the response (context overflow, or the model server "
                                      "is not the training config: return_token_id_information)", reward)
    prompt = [int(t) for t in items[0].get("prompt_token_ids") or []]
    seen = list(prompt)
    resp: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    contiguous, break_at = True, -1
    for k, it in enumerate(items):
        p = [int(t) for t in it.get("prompt_token_ids") or []]
        g = [int(t) for t in it["generation_token_ids"]]
        lp = [float(x) for x in it.get("generation_log_probs") or []]
        if len(lp) != len(g):
            return failed_generation(row, f"turn {k + 1}: {len(g)} generated tokens but {len(lp)} logprobs", reward)
        if k > 0:
            if p[: len(seen)] != seen:  # the history was re-tokenised differently: keep the ids, mask the sample
                if contiguous:
                    break_at = next((i for i, (a, b) in enumerate(zip(p, seen)) if a != b), min(len(p), len(seen)))
                contiguous = False
            new = p[len(seen):]
            resp += new
            mask += [0] * len(new)
            lps += [0.0] * len(new)
            seen = list(p)
        resp += g
        mask += [1] * len(g)
        lps += lp
        seen += g
    truncated = is_truncated(response) or (max_model_len is not None and len(prompt) + len(resp) >= max_model_len)
    return GymGeneration(prompt_ids=prompt, response_ids=resp, logprobs=lps, truncated=bool(truncated),
                         loss_mask=tuple(mask), reward=reward, agent_ref=agent, turns=len(items),
                         contiguous=contiguous, mask_sample=bool(result.get("mask_sample")), break_at=break_at)


def failed_generation(row: dict, why: str, reward: float = 0.0) -> GymGeneration:  # noqa: ARG001
    """A placeholder sample for a rollout that failed: one masked token, reward 0, counted by the driver."""
    return GymGeneration(prompt_ids=[0], response_ids=[0], logprobs=[0.0], truncated=False, loss_mask=(0,),
                         reward=0.0, agent_ref=_agent_name(row), turns=0,
                         contiguous=True, failed=why[:500])


def _agent_name(row: dict) -> str:
    ref: Any = row.get("agent_ref") or {}
    return str(ref.get("name", "")) if isinstance(ref, dict) else str(ref)
