"""Prompt text → token ids, in one place for every rollout backend (the driver tokenises, engines get ids).

env.chat_template=true wraps each prompt in the tokenizer's chat template (with env.system_prompt and
the generation prompt); false sends the raw text; null (default) = on exactly when the tokenizer has a
template (instruct models). A prompt may also be a list of chat messages [{"role", "content"}, ...].

The system prompt, one rule for train and val alike: a prompt that carries its own system message keeps it (and
env.system_prompt is not added to it); every other prompt gets env.system_prompt (null: none). prompting.json
records, per split, how many prompts took which (system_prompt_source) and the first prompt as rendered.
"""

from __future__ import annotations

import os
from typing import Any

from ..spec.schema import EnvSpec
from .usercode import UserCodeError


def templating_on(tokenizer, env: EnvSpec) -> bool:
    if env.chat_template is None:
        return bool(getattr(tokenizer, "chat_template", None))
    return env.chat_template


def messages_for(prompt: Any, env: EnvSpec) -> list[dict]:
    msgs = list(prompt) if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": str(prompt)}]
    if env.system_prompt and not any(m.get("role") == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": env.system_prompt})
    return msgs


def render(tokenizer, prompt: Any, env: EnvSpec) -> str:
    """The exact text the model is given for this prompt."""
    if templating_on(tokenizer, env):
        return tokenizer.apply_chat_template(messages_for(prompt, env), tokenize=False, add_generation_prompt=True)
    if isinstance(prompt, (list, tuple)):
        raise UserCodeError("a prompt is a list of chat messages but env.chat_template=false "
                            "(or the tokenizer has no chat template): set env.chat_template=true")
    return f"{env.system_prompt}\n{prompt}" if env.system_prompt else str(prompt)


def encode(tokenizer, prompt: Any, env: EnvSpec) -> list[int]:
    if templating_on(tokenizer, env):  # the template carries its own special tokens (BOS included)
        return list(tokenizer(render(tokenizer, prompt, env), add_special_tokens=False)["input_ids"])
    return list(tokenizer(render(tokenizer, prompt, env))["input_ids"])


def prompt_lengths(tokenizer: Any, prompts: list, env: EnvSpec, chunk: int = 8192) -> list[int]:
    """Token count of each prompt as encode() makes it, tokenised in batches (pre-flight over a whole data set).
    Prompts rendered with a long shared head (env.system_prompt, the chat template's) are counted by their tails:
    the head is tokenised once (shared_head_lengths), not once per prompt."""
    on = templating_on(tokenizer, env)
    fast = getattr(tokenizer, "is_fast", False) and getattr(tokenizer, "backend_tokenizer", None)
    out: list[int] = []
    for i in range(0, len(prompts), chunk):
        texts = [render(tokenizer, p, env) for p in prompts[i:i + chunk]]
        if fast:  # the Rust tokenizer's encodings, without transformers' per-row conversion
            shared = shared_head_lengths(fast, texts, not on)
            out += shared if shared is not None else [len(x.ids) for x in fast.encode_batch(
                texts, add_special_tokens=not on)]
        else:
            out += [len(x) for x in tokenizer(texts, add_special_tokens=not on)["input_ids"]]
    return out


SHARED_HEAD_MIN = 256  # rendered prompts that share this many leading characters are counted by their tails
CUT_MARGIN = 64  # characters of shared text kept in each tail (the cut is a token boundary this far before the end)
EXACT_CHECKS = 8  # tails' counts compared with a whole encoding: the longest, the shortest and these spread out


def shared_head_lengths(fast: Any, texts: list[str], special: bool) -> list[int] | None:
    """Each text's token count, the shared head (a system prompt, a template's preamble: its common prefix) tokenised
    once: cut at a token boundary CUT_MARGIN characters inside the head, count = head's tokens + the tail's. None
    (count them whole) when the head is short or the cut does not tokenise as it does in the whole text; the
    longest, the shortest and EXACT_CHECKS more are compared with their whole encodings (None on any difference)."""
    head = len(os.path.commonprefix(texts)) if len(texts) > 1 else 0
    if head < SHARED_HEAD_MIN:
        return None
    whole = fast.encode(texts[0], add_special_tokens=special)
    k = _cut_token(whole.offsets, head - CUT_MARGIN)
    if k is None:
        return None
    cut = whole.offsets[k][0]
    tail = fast.encode(texts[0][cut:], add_special_tokens=False).ids
    if whole.ids[k:k + len(tail)] != tail:
        return None
    base = len(whole.ids) - len(tail)
    lengths = [base + len(x.ids) for x in fast.encode_batch([t[cut:] for t in texts], add_special_tokens=False)]
    check = {max(range(len(texts)), key=lengths.__getitem__), min(range(len(texts)), key=lengths.__getitem__),
             *range(0, len(texts), max(1, len(texts) // EXACT_CHECKS))}
    if any(len(fast.encode(texts[i], add_special_tokens=special).ids) != lengths[i] for i in check):
        return None
    return lengths


def _cut_token(offsets: list, at: int) -> int | None:
    """The last token that starts cleanly (after the previous token's end, not at 0) at or before character `at`."""
    for k in range(len(offsets) - 1, 0, -1):
        start = offsets[k][0]
        if 0 < start <= at and offsets[k - 1][1] <= start and offsets[k - 1][0] < start:
            return k
    return None


class PromptTooLong(UserCodeError):
    pass


def encode_prompts(tokenizer, prompts: list, env: EnvSpec) -> list[list[int]]:
    """Token ids of each Prompt (its `.text`); a prompt over env.max_prompt_tokens is an error naming it."""
    out = []
    for p in prompts:
        ids = encode(tokenizer, p.text, env)
        if len(ids) > env.max_prompt_tokens:
            where = f" (row at {p.source})" if getattr(p, "source", "") else ""
            raise PromptTooLong(f"a prompt{where} is {len(ids)} tokens > env.max_prompt_tokens={env.max_prompt_tokens}"
                                f": {str(p.text)[:80]!r}; raise env.max_prompt_tokens (and "
                                "train.max_total_sequence_length) or shorten the prompt")
        out.append(ids)
    return out


def own_system(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and any(m.get("role") == "system" for m in prompt)


def system_source(prompts: list, env: EnvSpec) -> str:
    """Where a split's system messages come from: '64 prompts: env.system_prompt', '12 prompts: their own system
    message; 52 prompts: env.system_prompt'."""
    own = sum(own_system(p) for p in prompts)
    rest = "env.system_prompt" if env.system_prompt else "none (env.system_prompt is null)"
    parts = [(own, "their own system message"), (len(prompts) - own, rest)]
    return "; ".join(f"{n} prompt{'s' if n != 1 else ''}: {what}" for n, what in parts if n)


def split_prompts(env: Any, n: int, val: bool = True) -> dict[str, list]:
    """Each split's prompts in the order the run gives them to the model, from step 1's first: a data set's whole
    first epoch (env=dataset, math), otherwise step 1's n prompts; and the validation set (val=False: a run that does
    not validate, whose env.val_path is not read). {} for an env with a loop of its own (rollout_source:
    env=nemo_gym, whose agents build what the model gets)."""
    if hasattr(env, "rollout_source"):
        return {}
    if hasattr(env, "table"):
        n = len(env.table("train").rows)
    return {"train": [p.text for p in env.train_prompts(1, 0, n)], **({"val": [p.text for p in env.val_prompts()]}
                                                                       if val else {})}


def prompting_record(tokenizer: Any, env: EnvSpec, splits: dict[str, list] | None = None) -> dict:
    """How prompts were built, for the train-data log and the run dir; with `splits` (split_prompts), the first
    prompt of each split as the model gets it and where its system messages come from."""
    on = templating_on(tokenizer, env)
    example = render(tokenizer, "<PROMPT>", env)
    record = {"chat_template": on, "chat_template_setting": env.chat_template, "system_prompt": env.system_prompt,
              "template": getattr(tokenizer, "chat_template", None) if on else None, "rendered_example": example}
    splits = {k: v for k, v in (splits or {}).items() if v}
    if splits:
        record["first_prompt"] = {k: render(tokenizer, v[0], env) for k, v in splits.items()}
        record["system_prompt_source"] = {k: system_source(v, env) for k, v in splits.items()}
    return record
