"""What the policy's HTTP server needs for Gym: a chat template, and tool-call parsing for tool environments.

`rollout/vllm.py` adds `http_server_args(spec, model_dir)` to the arguments of its OpenAI server:
* `--chat-template` when the tokenizer has none (the tiny model's byte-level tokenizer ships none; Gym only
  speaks chat, and vLLM refuses chat requests without a template): data/chatml.jinja;
* `--enable-auto-tool-choice --tool-call-parser P` when env.gym_tool_call_parser is set (tool environments send
  `tool_choice: auto`; without a parser vLLM answers 400 and every `/run` fails with 500).
"""

from __future__ import annotations

import json
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


def http_server_args(spec, model_dir: str | Path) -> list[str]:
    if str(spec.env.name) != "nemo_gym":
        return []
    args: list[str] = []
    if not has_chat_template(model_dir):
        args += ["--chat-template", str(CHATML)]
    parser = getattr(spec.env, "gym_tool_call_parser", None)
    if parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    return args
