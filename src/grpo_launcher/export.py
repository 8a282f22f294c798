"""`launch.py export RUN_DIR [--step N | --last] [--out DIR]`: a checkpoint as a plain Hugging Face directory
(config.json, model.safetensors, generation_config.json + the tokenizer) that transformers and vLLM load.

The default is the best checkpoint by checkpoint.metric (else the latest); the output defaults to
RUN_DIR/export/step_NNNNNN/. The directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")
MODEL_RECORD = "model.json"  # RUN_DIR/model.json: the HF directory the run loaded (tokenizer source)


class ExportError(Exception):
    """What `export` (and `eval --step`) cannot take: the argument it names (`key`) and why."""

    def __init__(self, message: str, key: str = "run_dir"):
        super().__init__(message)
        self.key = key


def pick_checkpoint(run_dir: Path, step: Optional[int], last: bool) -> Path:
    from .checkpoint import CheckpointManager
    from .runfiles import load_spec_file

    spec = load_spec_file(run_dir / "spec.yaml")
    ckpt = CheckpointManager(run_dir / "checkpoints", spec)
    done = ckpt.complete()
    if not done:
        raise ExportError(f"{run_dir} has no complete checkpoint (checkpoints/step_*)")
    if step is not None:
        found = [p for p in done if p.name == f"step_{step:06d}"]
        if not found:
            raise ExportError(f"no checkpoint of step {step} in {run_dir / 'checkpoints'}; there are: "
                              f"{', '.join(p.name for p in done)}", key="--step")
        return found[0]
    return (None if last else ckpt.best()) or ckpt.latest()


def tokenizer_source(run_dir: Path, ckpt: Path) -> Path:
    """Where the run's tokenizer lives: in the checkpoint, or the model directory the run loaded."""
    if any((ckpt / "policy" / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return ckpt / "policy"
    record = run_dir / MODEL_RECORD
    if record.is_file():
        model_dir = Path(json.loads(record.read_text())["model_dir"])
        if model_dir.is_dir():
            return model_dir
    from .runfiles import load_spec_file

    spec = load_spec_file(run_dir / "spec.yaml")
    if spec.model.path and Path(spec.model.path).is_dir():
        return Path(spec.model.path)
    raise ExportError(f"cannot find the run's tokenizer: not in {ckpt / 'policy'}, no {record}, and "
                      f"model.path={spec.model.path}")


def export(run_dir: Path, step: Optional[int] = None, last: bool = False, out: Optional[Path] = None) -> Path:
    run_dir = Path(run_dir).resolve()
    if not (run_dir / "spec.yaml").is_file():
        raise ExportError(f"{run_dir} is not a run dir (no spec.yaml)")
    ckpt = pick_checkpoint(run_dir, step, last)
    policy = ckpt / "policy"
    if not (policy / "config.json").is_file():
        raise ExportError(f"{ckpt} holds no HF weights ({policy}/config.json)")
    out = Path(out) if out else run_dir / "export" / ckpt.name
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in policy.iterdir():
        if f.is_file():
            shutil.copy2(f, tmp / f.name)
    src = tokenizer_source(run_dir, ckpt)
    if src != policy:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
    _check_loads(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _check_loads(path: Path) -> None:
    """What a user will do with it: AutoConfig + AutoTokenizer (weights are the HF save of the checkpoint)."""
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.eos_token_id is None:
        raise ExportError(f"the exported tokenizer in {path} has no EOS token")


def main(args: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch.py export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a run directory (or a run name under --root)")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: best, else last)")
    ap.add_argument("--last", action="store_true", help="the latest checkpoint instead of the best")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default RUN_DIR/export/step_N)")
    ap.add_argument("--root", type=Path, default=Path(os.environ.get("GRPO_OUTPUT_ROOT", "outputs")),
                    help="where run dirs live, for a run name (default ./outputs)")
    ns = ap.parse_args(args)
    run_dir = ns.run_dir if (ns.run_dir / "spec.yaml").exists() else ns.root / ns.run_dir
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        out = export(run_dir, ns.step, ns.last, ns.out)
    except ExportError as exc:  # bad input: exit 2 with a config error naming the argument, like a run's
        from .exit_codes import ExitCode
        from .spec.errors import ConfigError, Violation

        print(ConfigError([Violation("export_target", (exc.key,), str(exc), "pick a run dir and a step with a "
                                     "complete checkpoint (launch.py status RUN)")]).render(), file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    print(f"exported {out}\n  load it: AutoModelForCausalLM.from_pretrained({str(out)!r}) / "
          f"vllm.LLM(model={str(out)!r})")
    return 0
