"""The end of a run: where everything is (run dir, checkpoints, MLflow, curve PNG, export command), and the
clean stop when user code (a reward function, an Env class, a prompt) fails mid-run."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointManager
from ..envs.prompting import prompting_record
from ..exit_codes import ExitCode
from ..export import RUN_MODEL_FILES, write_model_record
from ..pasteable import arg, override
from ..plan import Plan
from ..runfiles import write_atomic
from ..secrets import has_secret_argument, redact_value
from ..spec.schema import RunSpec
from .plot import CURVES, plot_curves
from .store import env_prefix
from .wandb_log import wandb_row

# a stop the run continues from (SIGTERM, Ctrl-C, a save-and-requeue): the block offers the resume command
STOPS = (ExitCode.TERMINATED, ExitCode.INTERRUPTED, ExitCode.REQUEUE)
CURVE_PNG = "reward_curve.png"
PROMPTING = "prompting.json"


def write_prompting(run_dir: Path, tokenizer, env, data_log=None, model_dir: Path | None = None,
                    splits: dict | None = None) -> dict:
    """How prompts are built (chat template, system prompt, an example): RUN_DIR/prompting.json, and beside
    the train-data log (train_data/prompting.json) when that is on. Also RUN_DIR/model.json: the HF directory
    the run loaded (where `launch.py export` finds the tokenizer)."""
    if model_dir is not None:  # + the tokenizer and generation config the run starts with (export carries them)
        changed = write_model_record(Path(run_dir), Path(model_dir))
        if changed:
            print(f"grpo-launcher: warning: {', '.join(changed)} in {model_dir} differ from those the run started "
                  f"with (copied in {Path(run_dir) / RUN_MODEL_FILES}): this resume reads the model directory's",
                  file=sys.stderr, flush=True)

    record = prompting_record(tokenizer, env, splits)  # splits: envs.prompting.split_prompts
    text = json.dumps(record, indent=1) + "\n"
    write_atomic(Path(run_dir) / PROMPTING, text)
    if data_log is not None:
        Path(data_log.dir).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(data_log.dir) / PROMPTING, text)
    return record


def read_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """RUN_DIR/metrics.jsonl → metric → [(step, value)]; a step logged twice (a resume) keeps its last line."""
    by_step: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            by_step[int(row.pop("step"))] = row
    series: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(by_step):
        for key, value in by_step[step].items():
            if isinstance(value, (int, float)):
                series.setdefault(key, []).append((step, float(value)))
    return series


def curves(spec: RunSpec, plan: Plan, state) -> Path | None:
    """The reward/validation curve (from RUN_DIR/metrics.jsonl) → RUN_DIR/reward_curve.png, logged to MLflow."""
    try:
        series = read_metrics(plan.run_dir / "metrics.jsonl")
        png = plot_curves(series, plan.run_dir / CURVE_PNG, f"{spec.name} ({spec.model.name}, env={spec.env.name})")
        tracker = getattr(state, "tracker", None)
        if png is not None and tracker is not None:
            tracker.log_artifact(png)
        return png
    except Exception as exc:  # noqa: BLE001 - a plot must never fail a finished run
        print(f"grpo-launcher: WARNING: no curve plot: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def resume_command(spec: RunSpec, plan: Plan, argv: list[str] | None = None) -> str:
    """The launch that continues this run from its last checkpoint. Started by a plain `launch.py key=value ...`
    (a local run): that command again with the run's name and output root written out (a name from `${now:...}`
    or an output root from $GRPO_OUTPUT_ROOT would start another run), with the MLFLOW_* variables it used. Else
    (a Slurm job's driver, a sweep point, `launch.py rerun`, a command holding a credential or an interpolation):
    the run's own spec.yaml under the same name, `launch.py rerun RUN_DIR name=NAME`, which resumes it."""
    argv = list(sys.argv if argv is None else argv)
    subcommand = len(argv) > 1 and "=" not in argv[1] and not argv[1].startswith("-")  # rerun, ...: bare words
    plain = not ({"-m", "--multirun"} & set(argv[1:]) or subcommand or has_secret_argument(argv)
                 or any("${" in a for a in argv[1:] if not a.startswith(("name=", "output_root="))))
    if argv and Path(argv[0]).name == "launch.py" and plain:
        kept = [a for a in argv[1:] if a.partition("=")[0].lstrip("+~") not in ("name", "output_root")]
        where = [override("output_root", spec.output_root), override("name", spec.name)]
        return " ".join([*env_prefix(spec), "python", shlex.join([argv[0], *kept]), *where])
    return f"python launch.py rerun {arg(plan.run_dir)} {override('name', spec.name)}"


def where_everything_is(spec: RunSpec, plan: Plan, state, png: Path | None, stopped: bool = False) -> str:
    """The end-of-run block; after a stop (exit 143/130/3) it offers the resume command instead of `rerun`."""
    ckpt = CheckpointManager(plan.checkpoint_dir, spec)
    best, last = ckpt.best(), ckpt.latest()
    tracker = getattr(state, "tracker", None)
    rows: list[tuple[str, object]] = [("run dir", plan.run_dir), ("spec", plan.run_dir / "spec.yaml"),
                                      ("summary", plan.run_dir / "summary.json")]
    if best is not None:
        rows.append((f"best checkpoint ({spec.checkpoint.metric})", best))
    if last is not None and last != best:
        rows.append(("last checkpoint", last))
    if png is not None:
        rows.append(("reward curve", png))
    if spec.logging.tensorboard:
        rows.append(("TensorBoard", f"tensorboard --logdir {arg(plan.run_dir / 'tensorboard')}"))
    if spec.logging.wandb:
        rows.append(("W&B", wandb_row(plan.run_dir)))
    if tracker is not None and spec.logging.mlflow:
        uri = redact_value(plan.tracking_uri)  # a password in the URI: ***
        rows.append(("MLflow", f"{uri}  experiment '{spec.logging.experiment}'  run {tracker.run_id}"))
        rows.append(("MLflow charts", chart_link(uri, tracker.experiment_id)))
    if stopped and last is not None:
        rows.append(("resume", resume_command(spec, plan)))
    elif (plan.run_dir / "repro").is_dir():
        rows.append(("reproduce", f"python launch.py rerun {arg(plan.run_dir)}"))
    if best is not None or last is not None:
        rows.append(("export (HF dir)", f"python launch.py export {arg(plan.run_dir)}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}} : {v}" for k, v in rows)


def chart_link(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's chart view, reward and validation first (tracking/mlflow_tracker.py CHART_VIEW_ID): on an
    MLflow server its URL; on a local store the UI to start (make mlflow-ui's port) and the URL it serves."""
    from .mlflow_tracker import chart_view_path  # here: it imports mlflow (logging.mlflow=false runs have none)

    route = chart_view_path(experiment_id)
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/#{route}"
    return f"mlflow ui --backend-store-uri {arg(tracking_uri)} --port 5000, then http://127.0.0.1:5000/#{route}"


def finish_run(spec: RunSpec, plan: Plan, state, rc: int) -> int:
    """After the loop: plot, then say where everything is. Returns rc unchanged."""
    png = curves(spec, plan, state)
    status = {0: "finished"}.get(rc, "stopped")
    print(f"grpo-launcher: run '{spec.name}' {status} at step {state.step}\n"
          f"{where_everything_is(spec, plan, state, png, stopped=rc in STOPS)}", flush=True)
    return rc


def diverged(exc: BaseException, state: Any) -> int:
    """Training produced NaN/inf (policy/update_log.Diverged, raised in a worker or the driver): no checkpoint of
    those weights, the MLflow run FAILED, the last checkpoint named. → 1."""
    cause = getattr(exc, "cause", None) or exc
    step = state.step + 1 if state is not None else 1
    latest = state.ckpt.latest() if state is not None else None
    if state is not None:
        mark_failed(state)
    print(f"error: step {step}: {cause}\ngrpo-launcher: run stopped; last checkpoint: {latest or 'none'}",
          file=sys.stderr, flush=True)
    return 1


def mark_failed(state: Any) -> None:
    """Metrics after the last checkpoint dropped, summary.json and the MLflow run FAILED (best effort: the run is
    ending on an error already)."""
    state.abort()
    try:
        state.finish("FAILED")
    except Exception:  # noqa: BLE001
        pass


def user_code_failed(exc: BaseException, trainer, state) -> int:
    """A reward function / Env / prompt failed: name it and the row, keep what was trained, mark FAILED. → 1."""
    cause = getattr(exc, "cause", None) or exc
    if state is None:  # before the loop state existed: nothing trained, nothing to keep
        print(f"error: {cause}", file=sys.stderr, flush=True)
        return 1
    saved = ""
    try:
        if trainer is not None and state.step > 0 and state.spec.checkpoint.enabled:
            latest = state.ckpt.latest()
            if latest is None or not latest.name.endswith(f"{state.step:06d}"):
                trainer.save(state.step, dict(state.last))  # the weights after the last completed step
            saved = f"; checkpoint of step {state.step} kept in {state.plan.checkpoint_dir}"
    except Exception as save_exc:  # noqa: BLE001
        saved = f"; saving a checkpoint failed too ({type(save_exc).__name__}: {save_exc})"
    mark_failed(state)
    print(f"error: {cause}\ngrpo-launcher: run stopped at step {state.step + 1}{saved}", file=sys.stderr, flush=True)
    return 1
