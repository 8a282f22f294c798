"""`launch.py export` gives THE trained policy as the user's model dir: the checkpoint's logits (exactly, in fp32),
the source model's generation_config.json (EOS / stop tokens, sampling defaults), tokenizer and chat template.
Checkpoints written as the policy workers write them (save_pretrained of the model they built), in-process."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from grpo_launcher.checkpoint import CheckpointManager
from grpo_launcher.export import ExportError, export
from grpo_launcher.export import main as export_main
from grpo_launcher.launch import rundir
from grpo_launcher.models.tiny import build_tokenizer
from grpo_launcher.plan import make_plan
from grpo_launcher.runfiles import load_spec_file
from grpo_launcher.spec.compose import load_spec

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2.5-Instruct's shape: config.json names one EOS, generation_config.json two, with sampling defaults
GENERATION = {"eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": True, "temperature": 0.7, "top_p": 0.8,
              "top_k": 20, "repetition_penalty": 1.05}


def source_model(root: Path) -> Path:
    """A user's model dir: a tiny Llama, its byte-level tokenizer with a chat template, a generation_config.json."""
    tok = build_tokenizer()
    tok.chat_template = CHATML
    cfg = LlamaConfig(vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=2, pad_token_id=0,
                      bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(root / "src")
    tok.save_pretrained(root / "src")
    (root / "src" / "generation_config.json").write_text(json.dumps(GENERATION))
    return root / "src"


def trained_run(root: Path, src: Path, build, save=None) -> tuple[Path, AutoModelForCausalLM]:
    """A run dir whose step-1 checkpoint holds `build(src)`'s model with perturbed weights (a trained policy),
    saved with save_pretrained as policy/ (torch_policy.save; `save(model, policy_dir)` instead) with its
    optimizer state."""
    spec = load_spec([f"output_root={root / 'runs'}", "name=ex", "logging.mlflow=false", f"model.path={src}"])
    plan = make_plan(spec)
    rundir.prepare(spec, plan)
    model = build(src)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)

    def write(tmp: Path) -> None:
        (save or (lambda m, d: m.save_pretrained(d)))(model, tmp / "policy")
        torch.save({"opt": {}, "sched": {}}, tmp / "optim.pt")

    CheckpointManager(plan.checkpoint_dir, spec).save(1, write, {"mlflow_run_id": None}, {})
    return plan.run_dir, model


def sharded_rank0_model(src: Path):
    """What a sharded torch run's rank 0 saves from (fsdp.load_model: from_config on the meta device, then filled)."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict())
    return model


def test_export_keeps_the_source_generation_config_and_the_trained_logits(tmp_path):
    src = source_model(tmp_path)
    run, policy = trained_run(tmp_path, src, sharded_rank0_model)
    out = export(run, out=tmp_path / "out", dtype="float32")
    assert json.loads((out / "generation_config.json").read_text()) == GENERATION
    gen = AutoModelForCausalLM.from_pretrained(out).generation_config
    assert (gen.eos_token_id, gen.temperature, gen.top_k) == ([2, 0], 0.7, 20)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHATML and tok.eos_token == "<|im_end|>"
    ids = torch.randint(0, 288, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        assert torch.equal(got, policy.eval()(ids).logits)


def test_export_carries_the_tokenizer_files_as_they_are(tmp_path):
    """A qwen2 model whose tokenizer.json has no Qwen split regex: AutoTokenizer's re-save (the export before) wrote
    Qwen2Tokenizer's NFC normalizer and regex into the exported tokenizer.json: "e\u0301" encoded otherwise."""
    src = source_model(tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    run, _ = trained_run(tmp_path, src, lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))
    out = export(run, out=tmp_path / "out")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    text = "caf\u0065\u0301 <|im_end|>"
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == \
        Tokenizer.from_file(str(src / "tokenizer.json")).encode(text).ids
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == AutoTokenizer.from_pretrained(src)(text).input_ids


def megatron_save(src: Path):
    """What megatron_policy.save writes: the weights (HF names) in one safetensors file beside the source's own
    config.json and generation_config.json, copied."""

    def save(model, policy: Path) -> None:
        policy.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(policy / "model.safetensors"))
        for name in ("config.json", "generation_config.json"):
            shutil.copy(src / name, policy / name)

    return save


def test_export_saved_dtype_loads_as_the_checkpoint_holds_it(tmp_path):
    """A bf16 source trained by megatron in fp32: `--dtype saved` loads in fp32 (config.json said bfloat16)."""
    src = source_model(tmp_path)
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(src)  # dtype: bfloat16
    run, policy = trained_run(tmp_path, src, lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32),
                              megatron_save(src))
    out = export(run, out=tmp_path / "out", dtype="saved")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32 and json.loads((out / "config.json").read_text())["dtype"] == "float32"
    ids = torch.randint(0, 288, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, policy.eval()(ids).logits)


def edited_save(drop: tuple[str, ...] = (), add: dict | None = None):
    """A policy save whose model.safetensors lost `drop` and gained `add` (a save or a map-back that got the names
    wrong): a real checkpoint, manifest and all, of weights that do not fit config.json."""

    def save(model, policy: Path) -> None:
        model.save_pretrained(policy)
        state = {k: v.contiguous() for k, v in load_file(policy / "model.safetensors").items() if k not in drop}
        save_file({**state, **(add or {})}, str(policy / "model.safetensors"), metadata={"format": "pt"})

    return save


@pytest.mark.parametrize("drop,add,said", [
    (("model.layers.1.mlp.down_proj.weight",), {}, "missing (1): model.layers.1.mlp.down_proj.weight"),
    ((), {"model.layers.2.mlp.down_proj.weight": torch.zeros(64, 96)},
     "unexpected (1): model.layers.2.mlp.down_proj.weight"),
    (("model.norm.weight",), {"model.norm.weight": torch.ones(32)},
     "of another shape (1): model.norm.weight [32] (the model's: [64])"),
])
def test_export_refuses_weights_that_do_not_fit_the_architecture(tmp_path, capsys, drop, add, said):
    """Was exported as good: from_pretrained filled a missing tensor at random (a warning among the load logs) and
    dropped an unexpected one, so the export scored and generated as another model."""
    src = source_model(tmp_path)
    run, _ = trained_run(tmp_path, src, lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32),
                         edited_save(drop, add))
    with pytest.raises(ExportError, match=re.escape(said)) as err:
        export(run, out=tmp_path / "out")
    assert err.value.key == "--step" and "nothing was exported" in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-out-*"))
    assert export_main([str(run), "--out", str(tmp_path / "out")]) == 2
    assert said in capsys.readouterr().err


def test_export_takes_a_tied_and_a_moe_model_as_saved(tmp_path):
    """No false refusal: a tied head left out of the file, and a MoE whose experts transformers fuses in memory but
    saves one by one."""
    for name, extra in (("tied", dict(tie_word_embeddings=True)),
                        ("moe", dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[]))):
        src = source_model(tmp_path / name)
        (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **extra}))
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(src)
        run, _ = trained_run(tmp_path / name, src, lambda d: AutoModelForCausalLM.from_pretrained(d))
        assert export(run, out=tmp_path / name / "out").is_dir(), name


def test_an_exported_gemma2_loads_with_the_attention_it_was_trained_with(tmp_path):
    """transformers 5 loads Gemma-2 with sdpa, which drops attn_logit_softcapping: `from_pretrained(export)` (what
    the export tells the user to run) computed another model than the policy (eager, models/attention.py)."""
    from grpo_launcher.models.attention import hf_attention

    src = source_model(tmp_path)
    gemma2 = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=0.5,
                  final_logit_softcapping=30.0, query_pre_attn_scalar=16, sliding_window=8, initializer_range=0.5)
    (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **gemma2}))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(src)
    run, policy = trained_run(tmp_path, src, lambda d: AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, **hf_attention(str(d))))
    out = export(run, out=tmp_path / "out", dtype="float32")
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 288, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, policy.eval()(ids).logits, atol=1e-5)
    assert hf_attention(str(out)) == {"attn_implementation": "eager"} == {
        k: v for k, v in json.loads((out / "config.json").read_text()).items() if k == "attn_implementation"}


def test_export_says_which_rule_picked_the_checkpoint(tmp_path, capsys):
    """Was 'the best by checkpoint.metric, else the latest' whichever applied: a checkpoint without the metric was
    exported as if it were the best one."""
    src = source_model(tmp_path)
    run, _ = trained_run(tmp_path, src, lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))
    assert export_main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert "checkpoint: step_000001 (the latest: no checkpoint has val/reward_mean (checkpoint.metric)" in \
        capsys.readouterr().out
    meta = run / "checkpoints" / "step_000001" / "meta.json"
    CheckpointManager(run / "checkpoints", load_spec_file(run / "spec.yaml")).save(
        2, lambda d: shutil.copytree(run / "checkpoints" / "step_000001" / "policy", d / "policy"),
        {"mlflow_run_id": None}, {"val/reward_mean": 0.25})
    assert meta.is_file() and export_main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert "checkpoint: step_000002 (the best by val/reward_mean = 0.25, highest of the kept checkpoints" in \
        capsys.readouterr().out


@pytest.mark.extended  # in make test-all: CI's time (benchmarks/results/ci-rehearsals.md)
def test_export_carries_what_the_run_trained_with_after_the_base_model_dir_changed_or_went(tmp_path):
    """export read the tokenizer and generation_config.json from the model dir as it was at export time: after the user
    edited the base model's generation_config.json the export was silently another model's; after deleting the dir,
    no export ('cannot find the run's tokenizer'). The run now keeps its own copies (RUN_DIR/model_files, sha256 in
    model.json), which export carries, saying what changed."""
    from helpers import launch, tiny_model

    base = tmp_path / "base"
    shutil.copytree(tiny_model(), base)
    started = {n: (base / n).read_bytes() for n in ("generation_config.json", "tokenizer.json", "tokenizer_config.json")}
    run = launch(f"model.path={base}", "name=r", "grpo.max_steps=1", "checkpoint.save_period=1", "grpo.val_period=1",
                 "logging.mlflow=false", f"output_root={tmp_path / 'out'}")
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = tmp_path / "out" / "r"
    gen = json.loads(started["generation_config.json"])
    (base / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 5, "temperature": 0.1}))

    first = launch("export", str(run_dir), "--out", str(tmp_path / "e1"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert (f"export: note: generation_config.json in {base} changed since the run began; the run's copies "
            f"({run_dir / 'model_files'}) are exported") in first.stdout, first.stdout
    shutil.rmtree(base)
    second = launch("export", str(run_dir), "--out", str(tmp_path / "e2"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"export: note: the model directory the run loaded, {base}, is gone" in second.stdout, second.stdout
    for out in (tmp_path / "e1", tmp_path / "e2"):
        assert {n: (out / n).read_bytes() for n in started} == started, out
        assert AutoTokenizer.from_pretrained(out).eos_token_id is not None
    # eval of the run dir: was refused ('no model directory at .../base'); the checkpoint and the run's copies stand in
    ev = launch("eval", str(run_dir), "grpo.max_val_samples=64")
    assert ev.returncode == 0, (ev.stdout + ev.stderr)[-3000:]
    assert f"grpo-launcher: model.path={base} is gone: the run's checkpoint with the tokenizer" in ev.stdout
    assert json.loads((run_dir / "eval" / "step_000001.json").read_text())["metrics"]
