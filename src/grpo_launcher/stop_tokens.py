"""The tokens generation stops at, read from the checkpoint as transformers reads them: the tokenizer's EOS ∪
the generation config's `eos_token_id` (an int or a list: Qwen3, Llama-3, Gemma-it and Phi-3 list their end-of-turn
token there). The generation config is generation_config.json, or, when the directory has none, config.json, as
`from_pretrained` falls back (transformers/generation/utils.py).

Every engine stops at exactly this set, resolved once per model directory by `stop_token_ids`: rollout=hf samples
until the first of them (rollout/hf.py), rollout=vllm passes it as `stop_token_ids` (rollout/vllm.py). Both keep the
stop token as the completion's last token (vLLM's `token_ids` end with it), so the loss mask covers it on either
engine, and a completion without one is truncated. The plan prints the set (`describe`, from the same files read
as JSON: pre-flight imports no transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

ORIGIN = "tokenizer EOS ∪ generation_config eos_token_id"


def stop_token_ids(model_dir: str | Path, tokenizer: Any = None) -> tuple[int, ...]:
    """The stop set of the checkpoint in `model_dir`, tokenizer EOS first (`tokenizer`: the one already loaded)."""
    from transformers import AutoTokenizer, GenerationConfig  # here: plan.py imports this module (pre-flight)

    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: the model config's, as from_pretrained does
        gen = GenerationConfig.from_pretrained(model_dir, config_file_name="config.json", _from_model_config=True)
    listed = gen.eos_token_id
    ids = [tokenizer.eos_token_id, *(listed if isinstance(listed, (list, tuple)) else [listed])]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def describe(model_path: Optional[str]) -> str:
    """The plan's line: the stop set as the checkpoint's files declare it, read as JSON (a dry run imports no
    transformers; tests/unit/test_stop_tokens.py checks it against `stop_token_ids`), or where it will be read."""
    if model_path is None:
        return f"the tiny model's EOS, built at start-up ({ORIGIN})"
    path = Path(model_path)
    if not path.is_dir():
        return f"read from {model_path} at start-up ({ORIGIN})"
    declared = {**_read_json(path / "special_tokens_map.json"), **_read_json(path / "tokenizer_config.json")}
    eos, listed = declared.get("eos_token"), None  # tokenizer_config.json wins, as in transformers
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos = eos if isinstance(eos, str) else None
    for name in ("generation_config.json", "config.json"):  # the first file present, as from_pretrained
        if (path / name).is_file():
            listed = _read_json(path / name).get("eos_token_id")
            break
    added = {t.get("content"): t.get("id") for t in _read_json(path / "tokenizer.json").get("added_tokens") or []
             if isinstance(t, dict)}
    ids = [added.get(eos), *(listed if isinstance(listed, list) else [listed])]
    names = {i: n for n, i in added.items()}
    shown = [f"{i} {names[i]!r}" if i in names else str(i) for i in dict.fromkeys(ids) if isinstance(i, int)]
    unmapped = f"{eos!r} (tokenizer EOS), " if eos and added.get(eos) is None else ""
    return unmapped + ", ".join(shown) + f" ({ORIGIN})"


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
