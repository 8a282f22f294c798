"""`launch.py eval` and `launch.py generate`: a checkpoint scored or sampled through the run's own engines, no training.

    python launch.py eval RUN_DIR|RUN_NAME|MODEL_DIR [--step N] [--out FILE] [key=value ...]
        scores the val set (or env.val_path=FILE) with the run's env and reward, through the same Ray workers,
        engines and validation code as training; prints the metrics and writes them as JSON
        (default RUN_DIR/eval/step_NNNNNN.json; a MODEL_DIR: OUTPUT_ROOT/.eval/<dir name>-<hash>/<dir name>.json,
        apart from every run dir and from another model dir of the same name; another val set
        than the run's own: named after it beside the run's, e.g. RUN_DIR/eval/step_NNNNNN.my_val.json)
    python launch.py generate RUN_DIR|RUN_NAME|MODEL_DIR --prompt TEXT [--prompt TEXT ...] [-n N] [--step N]
        N samples per prompt from the checkpoint (the newest, or --step N), the run's chat template and sampling;
        the prompt budget (env.max_prompt_tokens) grows to the longest prompt given, as the model gets it

A run dir's checkpoint is loaded into the policy workers as a resume does (the newest, or --step N); a MODEL_DIR
(an HF directory, e.g. `launch.py export`'s) is composed as `python launch.py model.path=MODEL_DIR [key=value ...]`.
key=value overrides change the run's spec for this command only (data: env.val_path, grpo.max_val_samples,
grpo.val_batch_size; sampling: rollout.temperature, rollout.max_new_tokens). Exit codes: 0 ok, 1 failed, 2 a bad
argument or config (a `config error` block naming the key).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypeVar

from omegaconf import OmegaConf

from ..checkpoint.manager import CheckpointManager, verify_checkpoint
from ..envs.base import Prompt
from ..envs.preflight import load_tokenizer, training_preflight
from ..envs.prompting import PromptTooLong, prompt_lengths
from ..exit_codes import ExitCode
from ..export import (GENERATION_CONFIG, RUN_MODEL_FILES, ExportError, pick_checkpoint, recorded_drift,
                      run_copy)
from ..plan import make_plan
from ..preflight.validate import validate
from ..runfiles import load_spec_file
from ..spec.compose import _override_key, load_spec, spec_to_yaml, to_spec
from ..spec.errors import ConfigError, Violation
from ..spec.schema import GROUPS, RunSpec
from ..tracking.repro import REPRO
from . import execute
from .names import UNSAFE
from .preflight import Launch
from .repro import callers_path, work_from_launch_dir

if TYPE_CHECKING:
    from ..train.driver import Trainer

T = TypeVar("T")

# rules about launching a training run under this name: an eval of a finished run trains nothing and writes no checkpoint
NOT_FOR_EVAL = {"run_name_not_finished", "run_name_checkpoints_compatible"}


@dataclasses.dataclass(frozen=True)
class Target:
    spec: RunSpec
    checkpoint: Optional[Path]  # the run's checkpoint to load (None: the model dir's weights as they are)
    out_dir: Path  # where the metrics JSON and the workers' phase file go (never the run's own phase.json)
    data_label: Optional[str] = None  # another val set than the run's own: its name (in the metrics file's name)

    def launch(self) -> Launch:
        """What launch.execute runs: the spec, its plan writing into out_dir (phase.json, prompting.json: not the
        run's), no job script (eval runs here)."""
        return Launch(self.spec, dataclasses.replace(make_plan(self.spec), run_dir=self.out_dir), None)


def parse(args: list[str], prog: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"launch.py {prog}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="a run dir, a run name under --root, or an HF model directory")
    ap.add_argument("overrides", nargs="*", help="key=value changes for this command (e.g. env.val_path=FILE)")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    ap.add_argument("--root", type=Path, default=Path(os.environ.get("GRPO_OUTPUT_ROOT", "outputs")),
                    help="where run dirs live, for a run name (default: $GRPO_OUTPUT_ROOT, else ./outputs)")
    if prog == "eval":
        ap.add_argument("--out", type=Path, default=None, help="the metrics JSON (default RUN_DIR/eval/step_N.json; "
                        "a directory: that name in it)")
    else:
        ap.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
        ap.add_argument("-n", type=int, default=1, help="samples per prompt (default 1)")
        ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    return ap.parse_intermixed_args(args)


def target(ns: argparse.Namespace) -> Target:
    """The spec (saved or composed, + overrides, validated) and the checkpoint to load; ConfigError if bad."""
    bad = [o for o in ns.overrides if "=" not in o]
    if bad:
        raise ConfigError([Violation("override_syntax", (b,), f"{b!r} is not key=value", "write key=value")
                           for b in bad])
    path = Path(ns.target)
    run_dir = next((p for p in (path, ns.root / ns.target) if (p / "spec.yaml").is_file()), None)
    if run_dir is not None:
        run_dir = run_dir.resolve()
        if getattr(ns, "out", None) is not None:
            ns.out = ns.out.absolute()  # --out is the caller's, before the working directory changes
        ns.overrides = [callers_path(o) for o in ns.overrides]  # and so is a path given here that is there
        # the spec's relative paths (env.val_path=data/val.jsonl) are the launch directory's: from elsewhere, eval
        # read the same name in this directory (another file, or none)
        work_from_launch_dir(run_dir / REPRO / "git.json")
        return _run_target(run_dir, ns.step, ns.overrides)
    if (path / "config.json").is_file():
        if ns.step is not None:
            raise ConfigError([Violation("eval_step", ("--step",), f"{path} is a model directory, not a run dir: "
                                         "it has no checkpoints to pick", "leave --step out")])
        return _model_target(path.resolve(), ns.overrides)
    raise ConfigError([Violation("eval_target", (ns.target,), f"'{ns.target}' is neither a run dir (spec.yaml), "
                                 f"a run under {ns.root.resolve()} (--root), nor an HF model dir (config.json)",
                                 "give a run dir, a run name, or a model directory")])


def _run_target(run_dir: Path, step: Optional[int], overrides: list[str]) -> Target:
    groups = [o for o in overrides if _override_key(o).lstrip("+") in (*GROUPS, "recipe")]
    if groups:  # a saved spec has no defaults list to pick from: `env=dataset` was 'Merge error: str is not ...'
        raise ConfigError([Violation("eval_overrides", (_override_key(groups[0]),),
                                     f"{groups[0]} picks a config group; an eval of a run keeps the run's groups",
                                     "change keys instead (env.name=dataset env.val_path=FILE, rollout.temperature=0)")])
    try:
        ckpt = pick_checkpoint(run_dir, step, last=True)
    except ExportError as exc:
        raise ConfigError([Violation("eval_step", ("--step",), str(exc), "pick a step that has a checkpoint")])
    cfg = OmegaConf.create(spec_to_yaml(load_spec_file(run_dir / "spec.yaml")))
    gone = cfg.model.path and not Path(str(cfg.model.path)).is_dir()
    stand_in = stand_in_model(run_dir, ckpt) if gone and "model.path" not in map(_override_key, overrides) else None
    if stand_in is not None:
        print(f"grpo-launcher: model.path={cfg.model.path} is gone: the run's checkpoint with the tokenizer and "
              f"generation config it trained with ({run_dir / RUN_MODEL_FILES}) stand in ({stand_in})", flush=True)
        cfg.model.path = str(stand_in)
    try:
        spec = to_spec(OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides)))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 (OmegaConf's errors: an unknown key, a wrong type)
        raise ConfigError([Violation("composition", ("<overrides>",), str(exc).splitlines()[0], "fix the override")])
    drift = tokenizer_drift(run_dir, spec)
    if GENERATION_CONFIG in drift:  # stop tokens or sampling defaults: another setting, not another vocabulary
        print(f"grpo-launcher: warning: {GENERATION_CONFIG} in {spec.model.path} differs from the run's "
              f"({run_dir / RUN_MODEL_FILES}): this command stops and samples by the one given", flush=True)
        drift.remove(GENERATION_CONFIG)
    if drift:
        raise ConfigError([Violation(
            "eval_same_tokenizer", ("model.path",), f"{', '.join(drift)} in {spec.model.path} differ from those run "
            f"{spec.name} trained with ({run_dir / RUN_MODEL_FILES}): its checkpoint's token ids would be read with "
            "another vocabulary or template", "model.path=DIR of a model with the run's tokenizer "
            "(leave model.path out: the run's own)")])
    other = (_env_name(spec), spec.env.val_path) != (str(cfg.env.name), cfg.env.val_path)  # cfg: the run's own
    return Target(_checked(spec), ckpt, run_dir / "eval", data_label(spec) if other else None)


def tokenizer_drift(run_dir: Path, spec: RunSpec) -> list[str]:
    """The tokenizer and generation-config files of the model directory an eval of a run reads that differ from
    those the run started with (RUN_DIR/model.json; none for a run dir from before it): another model.path scored
    the run's weights through another vocabulary, silently (val/reward_mean 0 against 0.23)."""
    path = Path(str(spec.model.path or ""))
    if not spec.model.path or not path.is_dir() or run_copy(run_dir) is None:
        return []
    return recorded_drift(run_dir, path) or []


def verified(t: Target, step: Optional[int]) -> Target:
    """The checkpoint to load verifies against its manifest (sizes, sha256), as a resume's and an export's do: a
    truncated or overwritten one reached the workers (a safetensors traceback after their start-up). --step N: refused,
    named; the default pick (the newest): the newest that verifies, said so."""
    if t.checkpoint is None:
        return t
    problem = verify_checkpoint(t.checkpoint)
    if problem is None:
        return t
    done = CheckpointManager(t.checkpoint.parent, t.spec).complete() if step is None else []
    older = [p for p in done if p.name < t.checkpoint.name]
    found = next((p for p in reversed(older) if verify_checkpoint(p) is None), None)
    if found is None:
        raise ConfigError([Violation("eval_checkpoint_verifies", ("--step",), f"checkpoint {t.checkpoint} fails "
                                     f"verification: {problem}" + ("; no older one verifies" if step is None else ""),
                                     f"--step N of a checkpoint that verifies (in {t.checkpoint.parent})")])
    print(f"grpo-launcher: {t.checkpoint.name} fails verification ({problem}): {found.name}, the newest checkpoint "
          "that verifies, is used (--step N picks another)", flush=True)
    return dataclasses.replace(t, checkpoint=found)


def stand_in_model(run_dir: Path, ckpt: Path) -> Optional[Path]:
    """The run's model directory was deleted or moved since the run: its checkpoint's HF files (config.json, weights)
    with the run's own copies of the tokenizer and generation config (RUN_DIR/model_files, export.py) as one model
    directory, of links, in RUN_DIR/eval/model-step_NNNNNN (eval and generate were refused: 'no model directory')."""
    copies = run_copy(run_dir)
    if copies is None or not (ckpt / "policy" / "config.json").is_file():
        return None
    stand_in = run_dir / "eval" / f"model-{ckpt.name}"
    shutil.rmtree(stand_in, ignore_errors=True)
    stand_in.mkdir(parents=True)
    for f in [*sorted((ckpt / "policy").iterdir()), *sorted(copies.iterdir())]:  # the run's copies win
        if f.is_file():
            (stand_in / f.name).unlink(missing_ok=True)
            (stand_in / f.name).symlink_to(f.resolve())
    return stand_in


def _model_target(model_dir: Path, overrides: list[str]) -> Target:
    spec = load_spec([f"model.path={model_dir}", *overrides])  # ConfigError: every problem, keys named
    other = {"env", "env.name", "env.val_path"} & {_override_key(o) for o in overrides}
    return Target(_checked(spec), None, model_eval_dir(spec, model_dir), data_label(spec) if other else None)


MODEL_EVALS = ".eval"  # under output_root: no run's dir (a run name never starts with '.': preflight/paths.py)


def model_eval_dir(spec: RunSpec, model_dir: Path) -> Path:
    """Where an eval or generate of a model dir writes (its metrics, the workers' phase.json and prompting.json):
    OUTPUT_ROOT/.eval/<dir name>-<hash of its path>. It was OUTPUT_ROOT/eval, the run dir of a run named `eval`
    (whose phase.json it overwrote), shared by every model dir of the same name (/a/export and /b/export: one
    metrics file)."""
    digest = hashlib.sha256(str(model_dir).encode()).hexdigest()[:8]
    return Path(spec.output_root).resolve() / MODEL_EVALS / f"{UNSAFE.sub('_', model_dir.name)}-{digest}"


def data_label(spec: RunSpec) -> str:
    """A val set's name for a file name: the val file's stem, else the env's name."""
    name = Path(spec.env.val_path).name.split(".")[0] if spec.env.val_path else _env_name(spec)
    return re.sub(r"[^A-Za-z0-9_+-]+", "_", name).strip("_") or "val"


def _env_name(spec: RunSpec) -> str:
    return str(getattr(spec.env.name, "value", spec.env.name))


def default_out(t: Target) -> Path:
    """RUN_DIR/eval/step_NNNNNN.json (a MODEL_DIR: model_eval_dir/<dir name>.json); another val set than the
    run's own is named after it (step_NNNNNN.<val set>.json): the run's own result is never overwritten."""
    base = t.checkpoint.name if t.checkpoint else Path(str(t.spec.model.path)).name
    return t.out_dir / (f"{base}.{t.data_label}.json" if t.data_label else f"{base}.json")


def metrics_file(out: Optional[Path], t: Target, overrides: Sequence[str] = ()) -> Path:
    """Where the metrics JSON goes, checked before anything runs (an --out that is a directory crashed with
    IsADirectoryError once the eval was done): --out DIR puts it there under its default name. The default file of
    an eval run otherwise (other overrides: rollout.temperature=0, grpo.max_val_samples=8) is not overwritten: this
    one goes beside it (step_NNNNNN.2.json, ...). A file that is no eval's metrics (--out RUN/spec.yaml) is refused."""
    path = free_default(default_out(t), overrides) if out is None else out / default_out(t).name if out.is_dir() else out
    above = next((p for p in path.parents if p.exists()), None)
    why = ("it is not a regular file" if path.exists() and not path.is_file()
           else f"{above} is not a directory" if above is not None and not above.is_dir()
           else "it exists and is not an eval's metrics file: it would be overwritten"
           if path.is_file() and recorded_overrides(path) is None else "")
    if why:
        raise ConfigError([Violation("eval_out", ("--out",), f"{path} cannot be written as a file ({why})",
                                     "give a file path, or a directory to write it in")])
    return path


def recorded_overrides(path: Path) -> Optional[list]:
    """The overrides an eval's metrics file records ([] before they were recorded), None when it is no eval's."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(record, dict) or not {"metrics", "data"} <= set(record):
        return None
    return list(record.get("overrides") or [])


def free_default(path: Path, overrides: Sequence[str]) -> Path:
    """The default metrics file, or the first step_NNNNNN.N.json beside it that holds no other eval's result: the
    same eval again (the same overrides) replaces its own file; another one (rollout.temperature=0 after the
    default) overwrote it, the first result lost."""
    n, found = 1, path
    while found.exists() and recorded_overrides(found) != list(overrides):
        n += 1
        found = path.with_name(f"{path.stem}.{n}.json")
    return found


def _checked(spec: RunSpec) -> RunSpec:
    spec = dataclasses.replace(spec, dry_run=False)
    if spec.cluster.kind.value != "local":
        raise ConfigError([Violation("eval_here", ("cluster.kind",), f"eval and generate run on this machine; the run "
                                     f"is cluster.kind={spec.cluster.kind.value}", "add cluster.kind=local "
                                     "cluster.nodes=1 (and cluster.gpus_per_node=N on a GPU node)")])
    scoring = dataclasses.replace(spec.grpo, val_at_end=True)  # eval scores the val set: env.val_path is required
    bad = [v for v in validate(dataclasses.replace(spec, grpo=scoring)) if v.rule not in NOT_FOR_EVAL]
    if bad:
        raise ConfigError(bad)
    return spec


def in_eval_terms(err: ConfigError) -> ConfigError:
    """The violations with their fixes said for eval / generate (EVAL_FIXES)."""
    return ConfigError([dataclasses.replace(v, fix=EVAL_FIXES.get(v.rule, v.fix)) for v in err.violations])


# a rule's fix said in eval's terms: the training fix ('rollout.temperature=1.0') answered a greedy eval
EVAL_FIXES = {"sampling_keeps_logprobs_exact": "eval and generate sample through the run's engines, which take a "
              "temperature ≥ 1e-05: rollout.temperature=1e-5 decodes (near-)greedily"}


def run_workers(t: Target, work: Callable[[Trainer], T]) -> T:
    """The target's Launch through the one door (launch.execute): the run's Ray workers on this machine, the
    checkpoint loaded as a resume does and its weights pushed to the engines, then work(trainer); the workers are
    stopped whatever happens."""
    def loaded(trainer: Trainer) -> T:
        w = trainer.w
        if t.checkpoint is not None:
            w.get("load", [p.load.remote(str(t.checkpoint)) for p in w.policy], w.policy)
        trainer.refit()  # the engines take the loaded weights
        return work(trainer)

    return execute(t.launch(), loaded)


def source_label(t: Target) -> str:
    return f"checkpoint {t.checkpoint}" if t.checkpoint else f"model {t.spec.model.path}"


def eval_main(args: list[str]) -> int:
    ns = parse(args, "eval")
    try:
        with training_preflight():  # eval scores the env's own prompts: env=toy's are counted as a launch's are
            t = target(ns)
        out = metrics_file(ns.out, t, ns.overrides)
        t = verified(t, ns.step)
        out = metrics_file(ns.out, t, ns.overrides)  # (the checkpoint's step names the default file)
    except ConfigError as err:
        print(in_eval_terms(err).render(), file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    print(f"grpo-launcher: eval of {source_label(t)} on {val_source(t.spec)}; metrics to {out}", flush=True)
    metrics = run_workers(t, lambda trainer: trainer.validate())
    record = {"checkpoint": str(t.checkpoint) if t.checkpoint else None, "model_path": t.spec.model.path,
              "step": int(t.checkpoint.name.split("_")[-1]) if t.checkpoint else None,
              "data": val_source(t.spec), "metrics": metrics,
              # what else this eval was run under (rollout.temperature=0 ...): the file was the same as the default's
              "overrides": list(ns.overrides),
              "sampling": {"temperature": t.spec.rollout.temperature, "max_new_tokens": t.spec.rollout.max_new_tokens}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    width = max([32, *(len(k) + 2 for k in metrics)])  # a long reward name ran into its value ("..._mean0")
    for key in sorted(metrics):
        print(f"{key:{width}s}{metrics[key]:.4g}")
    print(f"grpo-launcher: eval metrics written to {out}", flush=True)
    return ExitCode.OK


def val_source(spec: RunSpec) -> str:
    """What was scored: the val file, or the env's own held-out set; and how many of it."""
    where = spec.env.val_path or f"env {getattr(spec.env.name, 'value', spec.env.name)}'s val set"
    n = spec.grpo.max_val_samples
    return f"{where} ({'all rows' if n is None else f'first {n} rows'})"


def generate_main(args: list[str]) -> int:
    ns = parse(args, "generate")
    try:
        if ns.n < 1:
            raise ConfigError([Violation("generate_n", ("-n",), f"must be ≥ 1, got {ns.n}", "e.g. -n 4")])
        t = fit_prompt_budget(verified(target(ns), ns.step), ns.prompt, ns.overrides)
    except ConfigError as err:
        print(in_eval_terms(err).render(), file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    prompts = [Prompt(text=p, answer="", agent_ref="generate") for p in ns.prompt]
    print(f"grpo-launcher: sampling {ns.n} per prompt from {source_label(t)}", flush=True)

    def sample(trainer: Trainer) -> list[str]:
        gens = trainer.generate(prompts, ns.n, seed=ns.seed)
        return [trainer.tok.decode(g.response_ids, skip_special_tokens=True) for g in gens]

    try:
        texts = run_workers(t, sample)
    except PromptTooLong as exc:  # fit_prompt_budget counted otherwise (an unreadable tokenizer): still no traceback
        print(ConfigError([Violation("generate_prompt_budget", ("env.max_prompt_tokens", "--prompt"), str(exc),
                                     "set env.max_prompt_tokens (and train.max_total_sequence_length)")]).render(),
              file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    for i, text in enumerate(texts):
        print(f"--- prompt {i // ns.n + 1} sample {i % ns.n + 1}: {ns.prompt[i // ns.n]!r}\n{text}", flush=True)
    return ExitCode.OK


def fit_prompt_budget(t: Target, prompts: list[str], overrides: list[str]) -> Target:
    """The prompts given, counted as the model gets them (chat template, system prompt): env.max_prompt_tokens grows
    to the longest, and train.max_total_sequence_length to hold it + rollout.max_new_tokens (said so). A budget set
    on the command line is kept: a prompt over it is a config error naming it."""
    spec = t.spec
    tok = load_tokenizer(spec)
    if tok is None:
        return t  # the model rules name an unreadable tokenizer
    lengths = prompt_lengths(tok, list(prompts), spec.env)
    empty = [repr(p) for p, n in zip(prompts, lengths) if n == 0]
    if empty:  # no token to condition on: was a worker's traceback (an empty index tensor) after start-up
        raise ConfigError([Violation("generate_prompt_empty", ("--prompt",), f"--prompt {', '.join(empty)} is no "
                                     "token as the model gets it (no chat template adds any)", "give a prompt text")])
    i = max(range(len(lengths)), key=lengths.__getitem__)
    longest, budget = lengths[i], spec.env.max_prompt_tokens
    if longest <= budget:
        return t
    if "env.max_prompt_tokens" in {_override_key(o) for o in overrides}:
        raise ConfigError([Violation("generate_prompt_budget", ("env.max_prompt_tokens", "--prompt"),
                                     f"--prompt {prompts[i]!r} is {longest} tokens as the model gets it, over "
                                     f"env.max_prompt_tokens={budget}",
                                     "leave env.max_prompt_tokens out (generate fits it to the prompts), or shorten "
                                     "the prompt")])
    total = max(spec.train.max_total_sequence_length, longest + spec.rollout.max_new_tokens)
    print(f"grpo-launcher: env.max_prompt_tokens={longest}: the longest prompt given, as the model gets it"
          + (f"; train.max_total_sequence_length={total}" if total != spec.train.max_total_sequence_length else ""),
          flush=True)
    spec = dataclasses.replace(spec, env=dataclasses.replace(spec.env, max_prompt_tokens=longest),
                               train=dataclasses.replace(spec.train, max_total_sequence_length=total))
    return dataclasses.replace(t, spec=_checked(spec))
