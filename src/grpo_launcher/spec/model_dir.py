"""model.path=DIR is enough: the architecture comes from DIR/config.json at pre-flight, the tokenizer is checked.
`model_facts` is the one reading of the resolved keys (head width, KV heads, tying) that rules and memory share.

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

# ModelSpec field -> the config.json keys that hold it, first present (and not null) wins: the names transformers'
# configs use (their attribute_map aliases included: GPT-2's n_embd, n_layer, n_head, n_positions, n_inner).
ARCH_KEYS: dict[str, tuple[str, ...]] = {
    "family": ("model_type",),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv"),
    "head_dim": ("head_dim",),
    "ffn_hidden_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "moe_top_k": ("num_experts_per_tok", "moe_topk"),
    "tie_word_embeddings": ("tie_word_embeddings",),
}
# Families whose MLP is 4 × hidden when the config has no width (GPT-2 and GPT-J write n_inner: null)
FFN_4X = ("gpt2", "gptj", "gpt_bigcode", "codegen", "bloom", "falcon", "gpt_neo")
# tie_word_embeddings when config.json omits it: the model class's default, False for these causal LMs
# (transformers 5's configuration_*.py, checked by tests/unit/test_model_facts.py); True for any other (PretrainedConfig's default: GPT-2, Gemma, OPT, ...)
UNTIED_BY_DEFAULT = frozenset("""
    afmoe apertus arcee aria_text axk1 axk2 bamba bitnet blt codegen cwm dbrx deepseek_v2 deepseek_v3
    deepseek_v32 deepseek_v4 diffllama doge dots1 emu3 exaone4 exaone_moe falcon_h1 flex_olmo fuyu git glm glm4
    glm4_moe glm4_moe_lite glm_moe_dsa gpt_neox gpt_oss gptj granite granitemoe granitemoe_swa granitemoehybrid
    granitemoeshared helium hrm_text hunyuan_v1_dense hunyuan_v1_moe hy_v3 hy_v4 hyperclovax jais2 jamba
    kimi_linear laguna llama llama4 llama4_text longcat_flash mamba2 mellum mimo_v2_flash minimax minimax_m2
    minimax_m3_vl_text ministral ministral3 mistral mixtral mllama moshi nanochat nemotron nemotron_h olmo olmo2
    olmo3 olmo_hybrid olmoe persimmon phi phi3 phi4_multimodal phimoe qwen2 qwen2_moe qwen3 qwen3_5 qwen3_5_moe
    qwen3_5_moe_text qwen3_5_text qwen3_moe qwen3_next qwen4_exp qwen4_exp_text reformer rembert rwkv seed_oss
    solar_open stablelm xlstm""".split())
# fields a checkpoint may leave unset and transformers not derive: null in the spec (the rules judge the rest)
OPTIONAL = ("head_dim",)
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


def _fallback(field: str, cfg: dict, found: dict[str, Any]) -> Any:
    """What transformers uses when config.json has no (or a null) value for `field`; None: nothing."""
    family = cfg.get("model_type")
    if field == "num_kv_heads":  # multi-head attention (multi-query: one KV head)
        return 1 if cfg.get("multi_query") else found.get("num_attention_heads")
    if field == "ffn_hidden_size" and ("n_inner" in cfg or family in FFN_4X) and "hidden_size" in found:
        return 4 * found["hidden_size"]
    if field == "num_layers":  # hybrids (nemotron_h) derive it from their layer list; config.json has no count
        layers = cfg.get("layers_block_type") or cfg.get("hybrid_override_pattern")
        return len(layers) if isinstance(layers, (list, str)) and layers else None
    if field in ("num_experts", "moe_top_k"):
        return 0  # dense
    if field == "tie_word_embeddings":
        return family not in UNTIED_BY_DEFAULT
    if field == "head_dim":  # the attention layers' getattr(config, "head_dim", hidden // heads)
        hidden, heads = found.get("hidden_size"), found.get("num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
            return hidden // heads
        return None  # uneven: left null, and rule heads_divide names it
    return None


def architecture(cfg: dict) -> tuple[dict[str, Any], list[str]]:
    """(ModelSpec fields resolved from the config as transformers resolves them, the required ones missing)."""
    found: dict[str, Any] = {}
    missing = []
    for field, names in ARCH_KEYS.items():
        value = next((cfg[n] for n in names if cfg.get(n) is not None), None)
        if value is None:
            value = _fallback(field, cfg, found)
        if value is not None:
            found[field] = value
        elif field not in OPTIONAL:
            missing.append(names[0])
    return found, missing


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """The attention shape as transformers builds it from config.json: what every rule and the memory model read
    (preflight/sizes.py heads_divide, preflight/engines.py's vLLM KV rule, preflight/memory_shapes.py arch_of, the
    builders in models/)."""

    head_dim: int  # config.json head_dim (model.head_dim), else hidden_size // num_attention_heads
    heads: int
    kv_heads: int  # num_key_value_heads
    tied: bool  # the output layer shares the embedding (tie_word_embeddings, else the model class's default)
    positions: int  # max_position_embeddings: the longest sequence the model's rotary tables are built for
    head_dim_keys: tuple[str, ...]  # the model.* keys head_dim comes from, for messages

    @property
    def q_dim(self) -> int:  # the query projection's width (≠ hidden_size when head_dim is set: Qwen3, Gemma)
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:  # one of K, V per token and layer, in elements
        return self.kv_heads * self.head_dim


def model_facts(m: ModelSpec) -> ModelFacts:
    """The resolved model keys (config.json's with model.path, see `resolve_model`) as transformers reads them."""
    keys = ("model.head_dim",) if m.head_dim else ("model.hidden_size", "model.num_attention_heads")
    return ModelFacts(head_dim=m.head_dim or m.hidden_size // max(m.num_attention_heads, 1),
                      heads=m.num_attention_heads, kv_heads=m.num_kv_heads, tied=m.tie_word_embeddings,
                      positions=m.max_position_embeddings, head_dim_keys=keys)


def source_key(cfg: dict, field: str) -> str:
    """The config.json key a field was read from (its first name when it was derived)."""
    names = ARCH_KEYS[field]
    return next((n for n in names if cfg.get(n) is not None), f"{names[0]} (absent: transformers' default)")


def _typed(field: str, value: Any) -> Any:
    """The config.json value as the ModelSpec field's type, or None when it is not one."""
    kind = {f.name: f.type for f in dataclasses.fields(ModelSpec)}[field]
    if kind == "bool":
        return value if isinstance(value, bool) else None
    if kind in ("int", "Optional[int]"):
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
        return value if ok else None
    return value if isinstance(value, str) and value.isidentifier() else None


def explicit_model_keys(spec: RunSpec, cli_keys: Iterable[str]) -> set[str]:
    """Model fields the user stated: named on the command line, or set to a non-default value by a config file."""
    default = ModelSpec()
    stated = {k.split(".", 1)[1] for k in cli_keys if k.startswith("model.")}
    return stated | {f.name for f in dataclasses.fields(ModelSpec) if getattr(spec.model, f.name) != getattr(default, f.name)}


def tokenizer_problems(path: Path) -> list[Violation]:
    """The tokenizer files must be there, with an EOS token (generation stops at it). A pad token may be missing
    (Llama-3's, Mistral's tokenizers have none): the EOS pads then (rollout/hf.py load_tokenizer)."""
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
        tokens.update({k: v for k, v in data.items() if k == "eos_token" and v} if isinstance(data, dict) else {})
    return [] if "eos_token" in tokens else [
        V("model_tokenizer", ("model.path",), f"the tokenizer in {path} has no eos_token: generation stops at EOS "
          "(and pads with it when there is no pad token)", f"set \"eos_token\" in {path / 'tokenizer_config.json'}")]


def is_dir(path: str) -> bool:
    """Path.is_dir, False where the path cannot be stat'ed (a name past NAME_MAX: rule field_values names it)."""
    try:
        return Path(path).is_dir()
    except OSError:
        return False


def resolve_model(spec: RunSpec, cli_keys: Iterable[str]) -> tuple[RunSpec, list[Violation]]:
    """Fill the model's architecture from model.path's config.json (when the directory is readable here)."""
    if not spec.model.path or not is_dir(spec.model.path):
        return spec, []  # null: the tiny model; not here: a cluster path (rule local_paths_exist covers local runs)
    path = Path(spec.model.path)
    cfg, problem = read_config(path)
    if cfg is None:
        return spec, [problem] if problem else []
    found, missing = architecture(cfg)
    out = [V("model_checkpoint", ("model.path",), f"{path / 'config.json'} lacks {', '.join(missing)}",
             "re-export the checkpoint with save_pretrained")] if missing else []
    explicit = explicit_model_keys(spec, cli_keys)
    fields: dict[str, Any] = {"name": path.name} if "name" not in explicit else {}
    for field, raw in found.items():
        value = _typed(field, raw)
        if value is None:
            out.append(V("model_checkpoint", ("model.path",), f"{path / 'config.json'}: {source_key(cfg, field)}="
                         f"{str(raw)[:40]} is not a valid {field}", "re-export the checkpoint with save_pretrained"))
            continue
        ours = getattr(spec.model, field)
        if field in explicit and ours != value:
            out.append(V("model_matches_checkpoint", (f"model.{field}", "model.path"),
                         f"model.{field}={ours} but {path / 'config.json'} says {source_key(cfg, field)}={value}",
                         f"drop model.{field} (it is read from the checkpoint), or point model.path at the model "
                         "you meant"))
        fields[field] = value
    out += tokenizer_problems(path)
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, **fields)), out
