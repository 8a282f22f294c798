"""`launch.py export RUN_DIR [--step N | --last] [--out DIR] [--dtype D]`: a checkpoint as a plain Hugging Face
directory (config.json, model.safetensors, generation_config.json + the tokenizer) that transformers and vLLM load.

The default is the best checkpoint by checkpoint.metric (else the latest); the output defaults to
RUN_DIR/export/step_NNNNNN/. The checkpoint is verified against its manifest first (sizes, sha256); only the regular
files of its policy/ are copied (a symlink is refused, never followed), and their tensors are checked against
config.json's architecture (built on the meta device): one missing, unexpected or of another shape is refused,
named. The directory is written under a temporary name and renamed when complete. The weights are written in bfloat16 (--dtype: float16, float32, or `saved`: as the
checkpoint holds them, the fp32 master weights of a torch run): floating tensors are cast, config.json's dtype says so
(saved: the dtype the tensors hold).
The run's tokenizer files byte for byte (unless the checkpoint holds a tokenizer) and its generation_config.json (EOS /
stop tokens, sampling defaults): those the run started with, copied at its launch into RUN_DIR/model_files/ with
their sha256 in RUN_DIR/model.json; the model directory the run loaded may have been edited, replaced or deleted
since (its files were read at export time: a silently different export, or none). A run dir from before the copy:
the model directory's files, checked against nothing.
--out is never emptied: an existing non-empty --out is refused unless it is an earlier
export of the same run (its EXPORT_RECORD names the run dir), which is replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from .checkpoint import CheckpointManager
from .checkpoint.manager import load_meta, sha256_file, verify_checkpoint
from .exit_codes import ExitCode
from .runfiles import load_spec_file, write_atomic
from .spec.errors import ConfigError, Violation

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "tiktoken.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")
MODEL_RECORD = "model.json"  # RUN_DIR/model.json: the HF directory the run loaded (tokenizer source)
EXPORT_RECORD = "grpo_export.json"  # OUT/grpo_export.json: which run and checkpoint this export came from
DTYPES = ("bfloat16", "float16", "float32", "saved")
GENERATION_CONFIG = "generation_config.json"
INDEX = "model.safetensors.index.json"
SAFETENSORS_FLOAT = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors' dtype names  # a sharded save's weight map (its metadata.total_size follows the cast)


class ExportError(Exception):
    """What `export` (and `eval --step`) cannot take: the argument it names (`key`) and why."""

    def __init__(self, message: str, key: str = "run_dir"):
        super().__init__(message)
        self.key = key

    @property
    def fix(self) -> str:
        if self.key == "--out":
            return "name a new or empty directory for --out (default: RUN_DIR/export/step_N)"
        return "pick a run dir and a step with a complete checkpoint (launch.py status RUN)"


def pick_checkpoint(run_dir: Path, step: Optional[int], last: bool) -> Path:
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
    picked = (None if last else ckpt.best()) or ckpt.latest()
    assert picked is not None  # `done` is not empty
    return picked


def why_picked(run_dir: Path, picked: str) -> str:
    """Why the default pick is this checkpoint, in the run's terms (was one sentence for both cases: 'the best by
    checkpoint.metric, else the latest', whichever applied)."""
    spec = load_spec_file(Path(run_dir) / "spec.yaml")
    c = spec.checkpoint
    best = CheckpointManager(Path(run_dir) / "checkpoints", spec).best()
    if best is None or best.name != picked:
        return f"the latest: no checkpoint has {c.metric} (checkpoint.metric); --step N picks another"
    value = load_meta(best)["metrics"][c.metric]
    return (f"the best by {c.metric} = {value:.4g}, {'highest' if c.higher_is_better else 'lowest'} of the kept "
            f"checkpoints; --last: the latest")


def source_dir(run_dir: Path) -> Optional[Path]:
    """The model directory the run loaded (RUN_DIR/model.json, else model.path), or None when it is gone."""
    record = run_dir / MODEL_RECORD
    if record.is_file():
        model_dir = Path(json.loads(record.read_text())["model_dir"])
        if model_dir.is_dir():
            return model_dir
    spec = load_spec_file(run_dir / "spec.yaml")
    return Path(spec.model.path) if spec.model.path and Path(spec.model.path).is_dir() else None


RUN_MODEL_FILES = "model_files"  # RUN_DIR/model_files/: the tokenizer and generation config the run started with


def model_files(model_dir: Path) -> dict[str, str]:
    """The tokenizer files and generation_config.json of an HF directory: name -> sha256."""
    return {n: sha256_file(model_dir / n) for n in (*TOKENIZER_FILES, GENERATION_CONFIG) if (model_dir / n).is_file()}


def write_model_record(run_dir: Path, model_dir: Path) -> list[str]:
    """At a launch: RUN_DIR/model.json (the HF directory the run loaded, its tokenizer and generation config files'
    sha256) and RUN_DIR/model_files/ (their copies), what `export` carries. A resume keeps the start's record and
    copies; returns the files of model_dir that differ from them now (the resumed run reads model_dir's)."""
    record_file, copies = Path(run_dir) / MODEL_RECORD, Path(run_dir) / RUN_MODEL_FILES
    if copies.is_dir():
        drift = recorded_drift(run_dir, model_dir)
        if drift is not None:
            return drift
    now = model_files(Path(model_dir))
    tmp = copies.with_name(f".tmp-{RUN_MODEL_FILES}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in now:
        shutil.copyfile(Path(model_dir) / name, tmp / name)
    shutil.rmtree(copies, ignore_errors=True)
    os.replace(tmp, copies)
    write_atomic(record_file, json.dumps({"model_dir": str(Path(model_dir).resolve()), "files": now}) + "\n")
    return []


def recorded_drift(run_dir: Path, model_dir: Path) -> Optional[list[str]]:
    """The tokenizer and generation-config files of model_dir that differ from those RUN_DIR/model.json records (the
    run's start); None without a readable record."""
    try:
        then = json.loads((Path(run_dir) / MODEL_RECORD).read_text())["files"]
        now = model_files(Path(model_dir))
        return sorted(n for n in {*then, *now} if then.get(n) != now.get(n))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def run_copy(run_dir: Path) -> Optional[Path]:
    """RUN_DIR/model_files/ when it holds what model.json lists (a run dir from before it: None)."""
    copies = run_dir / RUN_MODEL_FILES
    try:
        listed = json.loads((run_dir / MODEL_RECORD).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return copies if copies.is_dir() and all((copies / n).is_file() for n in listed) else None


def drift_note(run_dir: Path, copies: Path) -> Optional[str]:
    """The model directory's tokenizer / generation config files that differ from the run's copies now (or that it
    is gone): said by export, which carries the copies."""
    record = json.loads((run_dir / MODEL_RECORD).read_text())
    model_dir = Path(record["model_dir"])
    if not model_dir.is_dir():
        return f"the model directory the run loaded, {model_dir}, is gone; the run's copy {copies} is exported"
    now = model_files(model_dir)
    changed = sorted(n for n in {*record["files"], *now} if record["files"].get(n) != now.get(n))
    if not changed:
        return None
    return (f"{', '.join(changed)} in {model_dir} changed since the run began; the run's copies ({copies}) are "
            "exported, as it trained with them")


def tokenizer_source(run_dir: Path, ckpt: Path) -> Path:
    """Where the run's tokenizer lives: in the checkpoint, the run's copy (RUN_DIR/model_files), or the model
    directory the run loaded."""
    if any((ckpt / "policy" / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return ckpt / "policy"
    copies = run_copy(run_dir)
    if copies is not None and any((copies / f).is_file() for f in TOKENIZER_FILES):
        return copies
    src = source_dir(run_dir)
    if src is None:
        raise ExportError(f"cannot find the run's tokenizer: not in {ckpt / 'policy'}, no {run_dir / MODEL_RECORD}, "
                          f"and model.path={load_spec_file(run_dir / 'spec.yaml').model.path}")
    return src


def carry_tokenizer(src: Path, dest: Path) -> None:
    """The source's tokenizer files as they are (the run loaded these): not re-saved through AutoTokenizer, which
    rewrites them (transformers 5: a qwen2 model's tokenizer.json gets Qwen2Tokenizer's NFC normalizer and split
    regex, tokenizer_config.json its class and load-time keys). Re-saved only where the source has none of them."""
    found = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not found:
        from transformers import AutoTokenizer  # here: launch.py imports this module (pre-flight stays light)

        AutoTokenizer.from_pretrained(src).save_pretrained(dest)
    for name in found:
        shutil.copyfile(src / name, dest / name)  # a hub cache's symlink is read through: dest gets the file


def carry_generation_config(run_dir: Path, dest: Path) -> None:
    """The source model's generation_config.json (its EOS / stop tokens, sampling defaults), not the checkpoint's:
    a sharded torch run builds its model from config.json alone (fsdp.load_model), so the one its checkpoints
    save derives from config.json (Qwen2.5-Instruct: one EOS of two, no sampling defaults). The run's copy when it
    has one (RUN_DIR/model_files: what it started with)."""
    src = run_copy(run_dir) or source_dir(run_dir)
    if src is not None and (src / GENERATION_CONFIG).is_file():
        shutil.copyfile(src / GENERATION_CONFIG, dest / GENERATION_CONFIG)


def export(run_dir: Path, step: Optional[int] = None, last: bool = False, out: Optional[Path] = None,
           dtype: str = "bfloat16") -> Path:
    run_dir = Path(run_dir).resolve()
    if not (run_dir / "spec.yaml").is_file():
        raise ExportError(f"{run_dir} is not a run dir (no spec.yaml)")
    ckpt = pick_checkpoint(run_dir, step, last)
    out = Path(out).absolute() if out else run_dir / "export" / ckpt.name
    check_out(out, run_dir)
    policy = ckpt / "policy"
    for path in (ckpt, policy):
        if path.is_symlink():
            raise ExportError(f"{path} is a symlink (to {os.readlink(path)}): a checkpoint holds regular files "
                              "only; nothing was exported", key="--step")
    if not (policy / "config.json").is_file():
        raise ExportError(f"{ckpt} holds no HF weights ({policy}/config.json)", key="--step")
    verify(ckpt)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        copy_regular_files(policy, tmp)
        if dtype != "saved":
            cast_weights(tmp, dtype)
        else:
            say_saved_dtype(tmp)
        pin_attention(tmp)
        src = tokenizer_source(run_dir, ckpt)
        if src != policy:
            carry_tokenizer(src, tmp)
        carry_generation_config(run_dir, tmp)
        check_tensors(tmp, ckpt)
        _check_loads(tmp)
        record = {"run_dir": str(run_dir), "checkpoint": ckpt.name, "step": int(ckpt.name.split("_")[-1]),
                  "dtype": dtype, "model_files": str(run_copy(run_dir) or source_dir(run_dir))}
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def earlier_export_of(out: Path, run_dir: Path) -> bool:
    """`out` was written by `export` from this run: its EXPORT_RECORD names the run dir, or it is the default
    RUN_DIR/export/step_NNNNNN (only export writes there)."""
    try:
        record = json.loads((out / EXPORT_RECORD).read_text())
        if Path(record["run_dir"]).resolve() == run_dir:
            return True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return out.parent.resolve() == run_dir / "export" and out.name.startswith("step_")


def check_out(out: Path, run_dir: Path) -> None:
    """--out is never emptied: a non-empty directory (or a file) there is refused unless it is an earlier export
    of this run."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError(f"--out {out} exists and is not a directory: nothing was written", key="--out")
    if out.is_dir() and any(out.iterdir()) and not earlier_export_of(out, run_dir):
        raise ExportError(f"--out {out} is not empty and is not an earlier export of {run_dir}: its contents are "
                          "kept, nothing was written", key="--out")


def verify(ckpt: Path) -> None:
    """The checkpoint's files against its manifest (sizes, sha256, nothing extra): a checkpoint that fails is not
    exported, and the message names the file."""
    problem = verify_checkpoint(ckpt, only="policy/")
    if problem:
        raise ExportError(f"checkpoint {ckpt} fails verification: {problem}; nothing was exported", key="--step")


def copy_regular_files(src: Path, dest: Path) -> None:
    """The regular files directly in `src` (not followed through a symlink: one is refused, named)."""
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        if entry.is_symlink():
            raise ExportError(f"{Path(entry.path)} is a symlink (to {os.readlink(entry.path)}): a checkpoint holds "
                              "regular files only; nothing was exported", key="--step")
        if entry.is_file(follow_symlinks=False):  # the content, not the run dir's private 0600 mode: an export is
            shutil.copyfile(entry.path, dest / entry.name, follow_symlinks=False)  # for others (umask's mode)


def cast_weights(directory: Path, dtype: str) -> None:
    """Every *.safetensors in `directory` with its floating tensors in `dtype` (integer tensors as they are), one file
    at a time; config.json's dtype and a shard index's total size follow."""
    import torch  # here: launch.py imports this module (pre-flight stays light)
    from safetensors import safe_open
    from safetensors.torch import save_file

    want = getattr(torch, dtype)
    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: (t.to(want) if t.is_floating_point() else t) for k in f.keys() for t in [f.get_tensor(k)]}
        save_file(tensors, str(path), metadata=metadata)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    set_config_dtype(directory, dtype)
    if (directory / INDEX).is_file():
        index = json.loads((directory / INDEX).read_text())
        index.setdefault("metadata", {})["total_size"] = total
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def set_config_dtype(directory: Path, dtype: str) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["dtype"] = dtype
    if "torch_dtype" in config:  # written by transformers before 4.56
        config["torch_dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def pin_attention(directory: Path) -> None:
    """config.json names eager attention where the config caps attention logits (Gemma-2): transformers 5 loads it
    with sdpa, which drops the cap, so a plain from_pretrained of the export computed another model than the one
    trained (the policy runs eager: models/attention.py's hf_attention, the same rule; not imported, a layer above)."""
    from transformers import AutoConfig  # here: launch.py imports this module (pre-flight stays light)

    if getattr(AutoConfig.from_pretrained(directory).get_text_config(), "attn_logit_softcapping", None):
        config = json.loads((directory / "config.json").read_text())
        if config.get("attn_implementation") in (None, "sdpa"):
            config["attn_implementation"] = "eager"
            (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def say_saved_dtype(directory: Path) -> None:
    """--dtype saved: config.json's dtype is the one the floating tensors hold (what from_pretrained and vLLM load
    by default). A megatron checkpoint's config.json is the source model's copy: fp32 weights under a bf16 source
    config were loaded as bf16."""
    from safetensors import safe_open  # here: launch.py imports this module (pre-flight stays light)

    found = set()
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found |= {f.get_slice(k).get_dtype() for k in f.keys()}
    floating = {SAFETENSORS_FLOAT[d] for d in found if d in SAFETENSORS_FLOAT}
    if len(floating) == 1:
        set_config_dtype(directory, floating.pop())


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename the complete `tmp` to `out`; an earlier export there is swapped out first, then removed."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = out.with_name(f".old-{out.name}-{os.getpid()}")
        os.replace(out, old)
    elif out.is_dir():
        out.rmdir()
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def file_tensors(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the *.safetensors in `directory`: name -> shape (headers only, no tensor is read)."""
    from safetensors import safe_open  # here: launch.py imports this module (pre-flight stays light)

    found: dict[str, tuple[int, ...]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return found


def model_tensors(directory: Path) -> tuple[list[tuple[str, tuple, dict[str, tuple]]], set[str], list]:
    """What config.json's architecture holds, built on the meta device (no memory): one (in-memory name, shape,
    {file name: shape}) per state-dict entry (the file names: transformers' conversion reverted, as save_pretrained
    writes a fused MoE's experts one by one), the tied aliases a file may leave out, and the patterns of keys the
    architecture ignores on load."""
    import torch  # here: launch.py imports this module (pre-flight stays light)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    entries = [(name, tuple(t.shape), {k: tuple(v.shape) for k, v in revert_weight_conversion(model, {name: t}).items()})
               for name, t in model.state_dict().items()]
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    ignored = [*(getattr(model, "_keys_to_ignore_on_load_missing", None) or []),
               *(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    return entries, tied, ignored


def per_expert_names(name: str, shape: tuple) -> dict[str, tuple]:
    """A stacked experts tensor [E, ...] (`...experts.up_proj`) as the per-expert names a checkpoint may hold
    (`...experts.{e}.up_proj.weight`: nemotron_h's FSDP checkpoints), whatever transformers' conversion reverts to."""
    stem, _, leaf = name.rpartition(".")
    if not stem.endswith(".experts") or len(shape) != 3:
        return {}
    return {f"{stem}.{e}.{leaf}.weight": shape[1:] for e in range(shape[0])}


def check_tensors(directory: Path, ckpt: Path, shown: int = 8) -> None:
    """The exported weights against config.json's architecture: a tensor missing (from_pretrained initialises it at
    random, with a warning), one the model has no place for (dropped), or one of another shape is refused, named."""
    import re  # here: with the rest of the check

    have = file_tensors(directory)
    entries, tied, ignored = model_tensors(directory)
    checked = [(name, shape, files, per_expert_names(name, shape)) for name, shape, files in entries]
    known = {name: shape for name, shape, files, alt in checked
             for name, shape in [(name, shape), *files.items(), *alt.items()]}
    missing = [name for name, shape, files, alt in checked if name not in have and not set(files) <= set(have)
               and not (alt and set(alt) <= set(have))
               and name not in tied and not any(re.search(p, name) for p in ignored)]
    unexpected = [k for k in have if k not in known and not any(re.search(p, k) for p in ignored)]
    shapes = [f"{k} {list(have[k])} (the model's: {list(known[k])})" for k in have if k in known and have[k] != known[k]]
    problems = [f"{what} ({len(keys)}): {', '.join(sorted(keys)[:shown])}{', ...' if len(keys) > shown else ''}"
                for what, keys in (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes))
                if keys]
    if problems:
        raise ExportError(f"checkpoint {ckpt}'s weights do not match its config.json ({len(have)} tensors): "
                          f"{'; '.join(problems)}; nothing was exported", key="--step")


def _check_loads(path: Path) -> None:
    """What a user will do with it: AutoConfig + AutoTokenizer (weights are the HF save of the checkpoint)."""
    from transformers import AutoConfig, AutoTokenizer  # here: launch.py imports this module (pre-flight stays light)

    AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.eos_token_id is None:
        raise ExportError(f"the exported tokenizer in {path} has no EOS token")


def parse_args(args: list[str]) -> argparse.Namespace:
    """`launch.py export`'s command line (exits 2 with its usage on a bad one, as argparse does)."""
    ap = argparse.ArgumentParser(prog="launch.py export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a run directory (or a run name under --root)")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: best, else last)")
    ap.add_argument("--last", action="store_true", help="the latest checkpoint instead of the best")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default RUN_DIR/export/step_N); a "
                    "non-empty one is refused unless it is an earlier export of this run")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                    help="the weights' dtype (default bfloat16; saved: as the checkpoint holds them)")
    ap.add_argument("--root", type=Path, default=Path(os.environ.get("GRPO_OUTPUT_ROOT", "outputs")),
                    help="where run dirs live, for a run name (default ./outputs)")
    return ap.parse_args(args)


def main(args: list[str]) -> int:
    ns = parse_args(args)
    run_dir = ns.run_dir if (ns.run_dir / "spec.yaml").exists() else ns.root / ns.run_dir
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        out = export(run_dir, ns.step, ns.last, ns.out, ns.dtype)
    except ExportError as exc:  # bad input: exit 2 with a config error naming the argument, like a run's
        print(ConfigError([Violation("export_target", (exc.key,), str(exc), exc.fix)]).render(), file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    copies = run_copy(run_dir.resolve())
    note = drift_note(run_dir.resolve(), copies) if copies is not None else None
    if note:
        print(f"export: note: {note}", flush=True)
    picked = json.loads((out / EXPORT_RECORD).read_text())["checkpoint"]
    why = "as asked" if ns.step is not None else "the latest, as asked" if ns.last else why_picked(run_dir, picked)
    print(f"exported {out}\n  checkpoint: {picked} ({why})\n  load it: AutoModelForCausalLM.from_pretrained("
          f"{str(out)!r}) / vllm.LLM(model={str(out)!r})")
    return 0
