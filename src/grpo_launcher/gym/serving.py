"""What the policy's HTTP server needs for Gym: a chat template, and tool-call parsing for tool environments.

`rollout/vllm.py` adds `http_server_args(spec, model_dir, stop_ids)` to the arguments of its OpenAI server:
* `--chat-template` when the tokenizer has none (the tiny model's byte-level tokenizer ships none; Gym only
  speaks chat, and vLLM refuses chat requests without a template): data/chatml.jinja;
* `--enable-auto-tool-choice --tool-call-parser P` when env.gym_tool_call_parser is set (tool environments send
  `tool_choice: auto`; without a parser vLLM answers 400 and every `/run` fails with 500);
* the prefix-token route (install_prefix_route, below): a multi-turn request's prompt keeps the engine's own
  tokens of the turns before, as NeMo-RL's `required_prefix_token_ids` server does (GRPO_GYM_PREFIX_ROUTE=0: off).
  A turn's end is any of the checkpoint's stop tokens (`stop_ids`: the worker's, stop_tokens.py), the set the
  engine stops at, not only the tokenizer's EOS (Qwen3, Llama-3 end a chat turn with a generation-config id).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Collection
from pathlib import Path

CHATML = Path(__file__).parent / "data" / "chatml.jinja"


def has_chat_template(model_dir: str | Path) -> bool:
    d = Path(model_dir)
    if (d / "chat_template.jinja").exists() or (d / "chat_template.json").exists():
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def http_server_args(spec, model_dir: str | Path, stop_ids: Collection[int]) -> list[str]:
    """`stop_ids`: the checkpoint's stop set, as the worker resolved it (stop_token_ids(model_dir))."""
    if str(spec.env.name) != "nemo_gym":
        return []
    if os.environ.get("GRPO_GYM_PREFIX_ROUTE", "1") != "0":  # 0: stock rendering (the benchmark's comparison)
        install_prefix_route(stop_ids)  # this runs in the engine's process, before its server is built
    args: list[str] = []
    if not has_chat_template(model_dir):
        args += ["--chat-template", str(CHATML)]
    parser = getattr(spec.env, "gym_tool_call_parser", None)
    if parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    return args


# ---------------------------------------------------------------------------- multi-turn: the engine's own tokens
# Stock vLLM renders a chat request's whole history through the chat template and tokenises the text again, so a
# turn's prompt need not start with the tokens the engine produced on the turns before (byte-level BPE merges
# differently; a parser's tool call is re-rendered). NeMo-RL serves Gym from a patched chat server that takes
# `required_prefix_token_ids` (or, as Gym sends them, the `prompt_token_ids` + `generation_token_ids` on the last
# assistant message it produced) and renders the prompt as exactly those tokens followed by the template's text
# from that message's end-of-turn token on. `install_prefix_route()` does the same on our engine's server: it wraps
# vLLM's OnlineRenderer.preprocess_chat, which both /v1/chat/completions and /tokenize (chat form) go through, so
# the prompt the engine generates from and the prompt ids Gym reads back are the same spliced sequence.

PREFIX_FIELD = "required_prefix_token_ids"


def required_prefix(request, messages) -> list[int] | None:
    """The token prefix a chat request must keep: the body's required_prefix_token_ids, else the last message that
    carries Gym's token information (its call's prompt ids + generation ids), else None."""
    ids = getattr(request, PREFIX_FIELD, None)
    if ids is None:
        extra = getattr(request, "model_extra", None) or {}
        ids = extra.get(PREFIX_FIELD)
    if ids:
        return [int(t) for t in ids]
    for m in reversed(list(messages or [])):
        if isinstance(m, dict) and m.get("prompt_token_ids") is not None and m.get("generation_token_ids") is not None:
            return [int(t) for t in m["prompt_token_ids"]] + [int(t) for t in m["generation_token_ids"]]
    return None


def splice_prefix(model_prefix: list[int], template_prefix: list[int], template: list[int],
                  stop_ids: Collection[int]) -> list[int]:
    """The engine's tokens up to (not including) their end-of-turn token, then the template's rendering from the
    end-of-turn token that closes the same message on. An end-of-turn token is any id of `stop_ids`.

    model_prefix:    the previous call's prompt + generation, as the engine produced them (a stop id last when it
                     stopped; none when max tokens cut it)
    template_prefix: the template's rendering of the history up to and including that assistant message
    template:        the template's rendering of the whole request
    stop_ids:        the checkpoint's stop set (stop_tokens.py), the tokens the engine stops at
    """
    if not model_prefix:
        return list(template)
    stop = frozenset(stop_ids)
    cut = len(model_prefix) - (1 if model_prefix[-1] in stop else 0)
    common = 0  # the two renderings agree up to the history's end (the generation prompt or the next turn differ)
    while common < min(len(template_prefix), len(template)) and template_prefix[common] == template[common]:
        common += 1
    start = next((i for i in reversed(range(common)) if template[i] in stop), -1)
    if start < 0:
        raise ValueError("the chat template put no end-of-turn token after the assistant message; cannot keep the "
                         "engine's own tokens as the prompt's prefix")
    return list(model_prefix[:cut]) + list(template[start:])


_INSTALLED = False
_STOP_IDS: frozenset[int] = frozenset()  # the served checkpoint's stop set, set by install_prefix_route


def install_prefix_route(stop_ids: Collection[int]) -> bool:
    """Patch vLLM's chat rendering in this process (the engine's) to keep a request's required token prefix,
    a turn ending at any of `stop_ids`. Idempotent (a later call sets the stop set); False when this vLLM has no
    OnlineRenderer.preprocess_chat (then stock behaviour: the samples' contiguity check masks what does not line up)."""
    global _INSTALLED, _STOP_IDS
    _STOP_IDS = frozenset(int(i) for i in stop_ids)
    if _INSTALLED:
        return True
    try:
        from vllm.renderers.online_renderer import OnlineRenderer  # here: vLLM may be absent (the except)
    except ImportError:
        return False
    original = getattr(OnlineRenderer, "preprocess_chat", None)
    if original is None:
        return False
    async def preprocess_chat(self, request, messages, *args, **kwargs):
        for m in messages or []:  # vLLM may hold tool_calls as a one-shot iterator: make it a list (copyable)
            if isinstance(m, dict) and m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
                m["tool_calls"] = list(m["tool_calls"])
        prefix = required_prefix(request, messages)
        history = copy.deepcopy(list(messages)) if prefix else None
        conversation, engine_inputs = await original(self, request, messages, *args, **kwargs)
        if not prefix or len(engine_inputs) != 1 or "prompt_token_ids" not in engine_inputs[0]:
            return conversation, engine_inputs
        last = max((i for i, m in enumerate(history) if isinstance(m, dict) and m.get("role") == "assistant"),
                   default=None)
        if last is None:
            return conversation, engine_inputs
        _, prefix_inputs = await original(self, request, history[: last + 1], *args, **kwargs)
        tokenizer = self.renderer.tokenizer
        ids = splice_prefix(prefix, list(prefix_inputs[0]["prompt_token_ids"]),
                            list(engine_inputs[0]["prompt_token_ids"]), _STOP_IDS)
        engine_inputs[0]["prompt_token_ids"] = ids
        if "prompt" in engine_inputs[0]:
            engine_inputs[0]["prompt"] = tokenizer.decode(ids)
        return conversation, engine_inputs

    preprocess_chat.__wrapped__ = original  # type: ignore[attr-defined]
    OnlineRenderer.preprocess_chat = preprocess_chat
    _INSTALLED = True
    return True
