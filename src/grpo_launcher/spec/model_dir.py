"""model.path=DIR is enough: the architecture comes from DIR/config.json at pre-flight, the tokenizer is checked.

Read as files (no transformers import: pre-flight stays well under a second). A model key given explicitly (on
the command line, or by a model option whose value differs from the schema default) that disagrees with the
checkpoint is a config error; every other architecture key is taken from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Optional

from .errors import Violation
from .schema import ModelSpec, RunSpec

# ModelSpec field -> the config.json keys that hold it (first present wins); a default when none is present
ARCH_KEYS: dict[str, tuple[tuple[str, ...], Any]] = {
    "family": (("model_type",), None),
    "num_layers": (("num_hidden_layers", "n_layer", "num_layers"), None),
    "hidden_size": (("hidden_size", "n_embd", "d_model"), None),
    "num_attention_heads": (("num_attention_heads", "n_head"), None),
    "num_kv_heads": (("num_key_value_heads",), "num_attention_heads"),  # absent = multi-head attention
    "ffn_hidden_size": (("intermediate_size", "n_inner", "ffn_dim"), None),
    "vocab_size": (("vocab_size",), None),
    "max_position_embeddings": (("max_position_embeddings", "n_positions"), None),
    "num_experts": (("num_experts", "num_local_experts", "n_routed_experts"), 0),
    "moe_top_k": (("num_experts_per_tok", "moe_topk"), 0),
    "tie_word_embeddings": (("tie_word_embeddings",), None),  # absent = not asserted: the spec's value stays
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
V = Violation


def read_config(path: Path) -> tuple[Optional[dict], Optional[Violation]]:
    """DIR/config.json as a dict (its text model's part for multimodal configs), or the violation naming the file."""
    file = path / "config.json"
    if not file.is_file():
        return None, V("model_checkpoint", ("model.path",), f"{path} has no config.json (not an HF model directory)",
                       "point model.path at a directory written by save_pretrained (config.json, weights, tokenizer)")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        return None, V("model_checkpoint", ("model.path",), f"cannot read {file}: {exc}", "fix the file's permissions")
    except json.JSONDecodeError as exc:
        return None, V("model_checkpoint", ("model.path",), f"{file} line {exc.lineno}: not valid JSON ({exc.msg})",
                       "repair or re-export config.json (save_pretrained)")
    if not isinstance(cfg, dict):
        return None, V("model_checkpoint", ("model.path",), f"{file} is not a JSON object", "re-export config.json")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    return cfg, None


def architecture(cfg: dict) -> tuple[dict[str, Any], list[str]]:
    """(ModelSpec fields found in the config, the required ones missing)."""
    found: dict[str, Any] = {}
    missing = []
    for field, (names, default) in ARCH_KEYS.items():
        value = next((cfg[n] for n in names if cfg.get(n) is not None), None)
        if value is None and isinstance(default, str):
            value = found.get(default)
        elif value is None:
            value = default
        if value is None and field != "tie_word_embeddings":
            missing.append(names[0])
        elif value is not None:
            found[field] = value
    return found, missing


def _typed(field: str, value: Any) -> Any:
    """The config.json value as the ModelSpec field's type, or None when it is not one."""
    kind = {f.name: f.type for f in dataclasses.fields(ModelSpec)}[field]
    if kind == "bool":
        return value if isinstance(value, bool) else None
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
        return value if ok else None
    return value if isinstance(value, str) and value.isidentifier() else None


def explicit_model_keys(spec: RunSpec, cli_keys: Iterable[str]) -> set[str]:
    """Model fields the user stated: named on the command line, or set to a non-default value by a config file."""
    default = ModelSpec()
    stated = {k.split(".", 1)[1] for k in cli_keys if k.startswith("model.")}
    return stated | {f.name for f in dataclasses.fields(ModelSpec) if getattr(spec.model, f.name) != getattr(default, f.name)}


def tokenizer_problems(path: Path) -> list[Violation]:
    """The tokenizer files must be there, with a pad and an EOS token (padding and stopping need them)."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return [V("model_tokenizer", ("model.path",), f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)})",
                  "save the tokenizer into the model directory (tokenizer.save_pretrained(DIR))")]
    tokens: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins, as in transformers
        try:
            data = json.loads((path / name).read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            return [V("model_tokenizer", ("model.path",), f"{path / name} is not readable JSON: {exc}",
                      "repair or re-save the tokenizer")]
        tokens.update({k: v for k, v in data.items() if k in ("pad_token", "eos_token") and v} if isinstance(data, dict) else {})
    return [V("model_tokenizer", ("model.path",), f"the tokenizer in {path} has no {kind} token: batches are padded "
              "with the pad token and generation stops at EOS",
              f"set \"{kind}\" in {path / 'tokenizer_config.json'} (e.g. the EOS token as pad)")
            for kind in ("pad_token", "eos_token") if kind not in tokens]


def resolve_model(spec: RunSpec, cli_keys: Iterable[str]) -> tuple[RunSpec, list[Violation]]:
    """Fill the model's architecture from model.path's config.json (when the directory is readable here)."""
    if not spec.model.path or not Path(spec.model.path).is_dir():
        return spec, []  # null: the tiny model; not here: a cluster path (rule local_paths_exist covers local runs)
    path = Path(spec.model.path)
    cfg, problem = read_config(path)
    if problem:
        return spec, [problem]
    found, missing = architecture(cfg)
    out = [V("model_checkpoint", ("model.path",), f"{path / 'config.json'} lacks {', '.join(missing)}",
             "re-export the checkpoint with save_pretrained")] if missing else []
    explicit = explicit_model_keys(spec, cli_keys)
    fields = {"name": path.name} if "name" not in explicit else {}
    for field, raw in found.items():
        value = _typed(field, raw)
        if value is None:
            out.append(V("model_checkpoint", ("model.path",), f"{path / 'config.json'}: {ARCH_KEYS[field][0][0]}="
                         f"{str(raw)[:40]} is not a valid {field}", "re-export the checkpoint with save_pretrained"))
            continue
        ours = getattr(spec.model, field)
        if field in explicit and ours != value:
            out.append(V("model_matches_checkpoint", (f"model.{field}", "model.path"),
                         f"model.{field}={ours} but {path / 'config.json'} says {ARCH_KEYS[field][0][0]}={value}",
                         f"drop model.{field} (it is read from the checkpoint), or point model.path at the model "
                         "you meant"))
        fields[field] = value
    out += tokenizer_problems(path)
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, **fields)), out
