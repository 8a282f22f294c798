"""What a family's causal-LM forward does to its output layer's result before it returns the logits, read from
config.json as transformers reads it, and which logprob head the policy uses for it.

The chunked head (train.logprob_chunk_tokens > 0, algos/linear_logprobs.py) computes each chunk's logits from the
hidden states itself, so it must apply the same post-processing: Gemma-2/3's `final_logit_softcapping`
(cap·tanh(z/cap)), Granite's `logits_scaling` (z / s), Cohere's `logit_scale` (z·s), ... (FAMILY_LOGITS, checked
against transformers' own modeling code by tests/unit/test_families.py). A family this module does not know but whose
config.json holds a key that looks like such a post-processing (SUSPECT) gets whole logits from the model's own
forward: slower, never wrong. Light (no torch): pre-flight and the plan read it; the torch worker applies it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

SOFTCAP, MULTIPLY, DIVIDE = "softcap", "multiply", "divide"

# model_type -> (config.json key, what the CausalLM forward does with it after lm_head, transformers' default when
# config.json omits the key). From transformers 5's modeling_*.py (GemmaXForCausalLM.forward: logits / cap, tanh,
# * cap when the cap is not None; Granite: logits / logits_scaling; Cohere: logits * logit_scale; ...).
_CAP = ("final_logit_softcapping", SOFTCAP)
FAMILY_LOGITS: dict[str, tuple[str, str, Optional[float]]] = {
    "gemma2": (*_CAP, 30.0), "gemma3": (*_CAP, None), "gemma3_text": (*_CAP, None), "gemma3n": (*_CAP, 30.0),
    "gemma3n_text": (*_CAP, 30.0), "gemma4": (*_CAP, None), "gemma4_text": (*_CAP, None),
    "gemma4_unified": (*_CAP, None), "gemma4_unified_text": (*_CAP, None), "vaultgemma": (*_CAP, 30.0),
    "nanochat": (*_CAP, 15.0), "recurrent_gemma": ("logits_soft_cap", SOFTCAP, 30.0),
    **{f: ("logits_scaling", DIVIDE, 1.0) for f in ("granite", "granite_swa", "granitemoe", "granitemoe_swa",
                                                     "granitemoehybrid", "granitemoeshared")},
    **{f: ("logit_scale", MULTIPLY, 0.0625) for f in ("cohere", "cohere2", "cohere2_moe")},
    "falcon_h1": ("lm_head_multiplier", MULTIPLY, 1.0),
    "hyperclovax": ("logits_scaling", MULTIPLY, 1.0),  # multiplies (Granite divides by the same key)
}
# keys of other families that name a post-processing of the logits (xlstm's output_logit_soft_cap, ...)
SUSPECT = re.compile(r"(final_|output_)?logits?_(soft_?cap(ping)?|scal(e|ing)|multiplier)|lm_head_multiplier"
                     r"|output_multiplier")


@dataclass(frozen=True)
class LogitTransform:
    """logits = f(z) for z = the output layer's result: z·multiply, then / divide, then cap·tanh(· / cap) (each
    only when set), in transformers' order of operations. `source` names the config.json key and value."""

    multiply: float = 1.0
    divide: float = 1.0
    softcap: Optional[float] = None
    source: str = ""

    def __call__(self, z: Any) -> Any:
        # z: tensor [n, V] (fp32) -> the family's logits [n, V]
        if self.multiply != 1.0:
            z = z * self.multiply
        if self.divide != 1.0:
            z = z / self.divide
        if self.softcap:
            z = (z / self.softcap).tanh() * self.softcap
        return z

    def slope(self, y: Any) -> Any:
        """d f / d z at the output y = f(z) (a tensor like y, or a number): for the backward."""
        scale = self.multiply / self.divide
        return scale if not self.softcap else (1 - (y / self.softcap) ** 2) * scale

    def describe(self) -> str:
        what = f"cap·tanh(z/cap), cap={self.softcap:g}" if self.softcap else \
            f"z·{self.multiply:g}" if self.multiply != 1.0 else f"z/{self.divide:g}"
        return f"{what} (config.json {self.source})"


def logit_transform(config: Mapping[str, Any]) -> Optional[LogitTransform]:
    """The post-processing a known family's forward applies to lm_head's output, None when it applies none
    (the identity, or a family FAMILY_LOGITS does not list: see unreproduced_keys)."""
    entry = FAMILY_LOGITS.get(str(config.get("model_type")))
    if entry is None:
        return None
    key, kind, default = entry
    value = config.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    source = f"{key}={value:g}" + ("" if key in config else " (absent: transformers' default)")
    if kind == SOFTCAP:
        return LogitTransform(softcap=float(value), source=source) if value else None
    if float(value) == 1.0:
        return None
    return LogitTransform(**{kind: float(value)}, source=source)


def unreproduced_keys(config: Mapping[str, Any]) -> list[str]:
    """config.json keys (key=value) of a family FAMILY_LOGITS does not list that may post-process its logits."""
    if str(config.get("model_type")) in FAMILY_LOGITS:
        return []
    return [f"{k}={v}" for k, v in config.items() if SUSPECT.fullmatch(k) and isinstance(v, (int, float))
            and not isinstance(v, bool) and v not in (0, 1)]


@dataclass(frozen=True)
class HeadChoice:
    """The policy's logprob head: chunked (`chunk` tokens of logits at a time, `transform` applied per chunk) or
    whole logits from the model's own forward (chunk 0); `why` is the plan's line."""

    chunk: int
    transform: Optional[LogitTransform]
    why: str


def head_choice(config: Optional[Mapping[str, Any]], chunk_tokens: int) -> HeadChoice:
    """What the torch worker builds for this config.json (None: not readable here: the family's defaults)."""
    if not chunk_tokens:
        return HeadChoice(0, None, "whole logits (train.logprob_chunk_tokens=0)")
    config = config or {}
    odd = unreproduced_keys(config)
    if odd:
        return HeadChoice(0, None, f"whole logits: {config.get('model_type')}'s config.json holds {', '.join(odd)}, "
                                   "a logit post-processing the chunked head does not reproduce")
    t = logit_transform(config)
    return HeadChoice(chunk_tokens, t, f"chunked, {chunk_tokens} tokens" + (f"; logits = {t.describe()}" if t else ""))


def head_for(model_dir: Optional[str], family: str, chunk_tokens: int) -> HeadChoice:
    """The head for a model directory's config.json; without one readable here (the tiny model built at start-up,
    a cluster path), the family's defaults."""
    cfg = read_text_config(model_dir)
    if cfg is not None or not model_dir:
        return head_choice(cfg if cfg is not None else {"model_type": family}, chunk_tokens)
    choice = head_choice({"model_type": family}, chunk_tokens)
    return dataclasses.replace(choice, why=f"{choice.why} ({model_dir}/config.json not readable here: {family}'s "
                                           "defaults; the workers read the file)")


def read_text_config(model_dir: Optional[str]) -> Optional[dict]:
    """DIR/config.json (its text model's part for a multimodal config, as spec/model_dir.py reads it), or None."""
    if not model_dir:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(cfg, dict) and "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    return cfg if isinstance(cfg, dict) else None
