"""Prompt text → token ids, in one place for every rollout backend (the driver tokenises, engines get ids).

env.chat_template=true wraps each prompt in the tokenizer's chat template (with env.system_prompt and
the generation prompt); false sends the raw text; null (default) = on exactly when the tokenizer has a
template (instruct models). A prompt may also be a list of chat messages [{"role", "content"}, ...].
"""

from __future__ import annotations

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


def prompt_lengths(tokenizer, prompts: list, env: EnvSpec, chunk: int = 8192) -> list[int]:
    """Token count of each prompt as encode() makes it, tokenised in batches (pre-flight over a whole data set)."""
    on = templating_on(tokenizer, env)
    fast = getattr(tokenizer, "is_fast", False) and getattr(tokenizer, "backend_tokenizer", None)
    out: list[int] = []
    for i in range(0, len(prompts), chunk):
        texts = [render(tokenizer, p, env) for p in prompts[i:i + chunk]]
        if fast:  # the Rust tokenizer's encodings, without transformers' per-row conversion
            out += [len(x.ids) for x in fast.encode_batch(texts, add_special_tokens=not on)]
        else:
            out += [len(x) for x in tokenizer(texts, add_special_tokens=not on)["input_ids"]]
    return out


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


def prompting_record(tokenizer, env: EnvSpec) -> dict:
    """How prompts were built, for the train-data log and the run dir."""
    on = templating_on(tokenizer, env)
    example = render(tokenizer, "<PROMPT>", env)
    return {"chat_template": on, "chat_template_setting": env.chat_template, "system_prompt": env.system_prompt,
            "template": getattr(tokenizer, "chat_template", None) if on else None, "rendered_example": example}
