"""MLflow tracking through `MlflowClient` (no fluent global run: several trackers may share a process).

Metrics are buffered until `commit()`, which the driver calls right after each checkpoint is written;
the buffered metrics also go into that checkpoint's meta.json (`pending()`), and a resumed run `replay()`s
them. A reopened run knows which (key, step) pairs MLflow already holds and never sends one twice: after
a crash at any point of a save, and a resume from any checkpoint, the step axis has every step exactly once.
A store that goes away mid-run (an http server restarting) does not stop the run: a failed commit keeps its
metrics buffered (and in the next checkpoint's pending metrics), prints a warning, and the next commit sends them;
the end of the run waits up to CLOSE_WAIT_S for the store.
A resume reopens the run dir's own MLflow run (RUN_DIR/mlflow_run.json, runfiles.py; else the checkpoint's) only when
that run belongs to this run dir: its tags name the run dir (absolute) and its run name is this run's. A copied (or moved) run dir starts a new MLflow run, said so, and its
steps so far are sent from metrics.jsonl (`backfill`); the original run is left as it was.
Secret values (by key name, or a password inside a URI) are redacted in params and the logged spec.yaml.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import requests
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from ..checkpoint.manager import flatten, spec_as_dict
from . import metric_names as M
from ..secrets import redact_text, redact_value
from ..spec.compose import spec_to_yaml
from ..spec.schema import RunSpec
from .store import quiet_store_tracebacks

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE = 6000
# Matched against the LAST part of a dotted key. `token` is anchored so that max_new_tokens stays visible.
SECRET_KEY = re.compile(r"token$|secret|password|passwd|api_key|access_key|private_key|^key$", re.IGNORECASE)
REDACTED = "***"
STATUSES = ("FINISHED", "FAILED", "KILLED")
# an http store that is away: MLflow's client retries 7 times with exponential backoff by default, at every
# checkpoint; our buffer takes over after 3 (timings: benchmarks/results/tracking.md). A user's
# MLFLOW_HTTP_REQUEST_MAX_RETRIES wins.
HTTP_RETRIES_ENV, HTTP_RETRIES = "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3"
# ... and each try waits for an answer this long (MLflow's default 120 s: a server that accepts but never answers,
# frozen or overloaded, held the loop ~8 min per checkpoint with no message). A user's MLFLOW_HTTP_REQUEST_TIMEOUT
# wins; a batch of 1000 values takes well under a second on a live server.
HTTP_TIMEOUT_ENV, HTTP_TIMEOUT = "MLFLOW_HTTP_REQUEST_TIMEOUT", "30"
UNREACHABLE = (MlflowException, requests.exceptions.RequestException, OSError)
CLOSE_WAIT_S = 120.0  # the end of a run waits this long for an away store to send what it buffered
CLOSE_RETRY_S = 5.0
# a sqlite store whose file is damaged: no retry brings it back (the end of the run does not wait for it)
CORRUPT_STORE = re.compile(r"database disk image is malformed|file is not a database")
RUN_DIR_TAG = "grpo.run_dir"  # the absolute run dir an MLflow run was started for (a resume checks it)


# the UI opens an experiment of this kind in its model-training view (charts), not the GenAI (traces) view
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# Chart order. MLflow's UI (3.x; its JS bundle, RunsChartsCardConfig) groups charts by the metric's prefix
# (the key up to its last "/"), sections in alphabetical order (buffer, time, train, val; "Model metrics" and
# "System metrics" last), charts alphabetically within a section: train/reward_mean would be the 27th chart.
# The run page keeps its layout in the browser only. The experiment's chart view can be stored server-side as a
# saved view: the experiment tag mlflow.sharedViewState.<id> (what the UI's "Save as new view" / "Share" writes),
# opened by ?viewStateShareKey=<id>. Ours puts a first section with the reward and validation charts; every
# other metric follows in the UI's own order.
CHART_VIEW_ID = "grpo-reward-first"
CHART_VIEW_TAG = f"mlflow.sharedViewState.{CHART_VIEW_ID}"
HEADLINE_SECTION = "Reward and validation"
HEADLINE_METRICS = (M.TRAIN_REWARD_MEAN, M.VAL_REWARD_MEAN, M.TRAIN_ACCURACY, M.VAL_ACCURACY)
RUN_NOTE = (f"GRPO run. Read first: {M.TRAIN_REWARD_MEAN} and {M.VAL_REWARD_MEAN} (the task's reward), then "
            f"{M.TRAIN_KL}, {M.TRAIN_CLIP_FRACTION}, {M.TIME_STEP_S}. Every step's metrics are also in "
            "RUN_DIR/metrics.jsonl.")


def param_value(value: Any) -> str:
    """A spec leaf as an MLflow param string: lists as JSON, capped at 6000 chars."""
    text = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return text[:MAX_PARAM_VALUE]


def is_secret(key: str) -> bool:
    return bool(SECRET_KEY.search(key.rsplit(".", 1)[-1]))


def flat_params(tree: dict[str, Any]) -> dict[str, str]:
    """Nested dict → {dotted.key: string}, secret-looking keys (and passwords inside URIs) redacted."""
    return {k: REDACTED if is_secret(k) and v not in (None, "", []) else param_value(redact_value(v))
            for k, v in flatten(tree).items()}


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def git_commit() -> str | None:
    """HEAD of the repo in the cwd, or None when git or a repo is not there."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def chart_view(created_ms: int) -> str:
    """The saved view (MLflow's envelope: name, createdAt, updatedAt, state as a JSON string): a first chart
    section with HEADLINE_METRICS as line charts over steps; the UI adds every other metric after it."""
    section = {"uuid": "grpo-headline", "name": HEADLINE_SECTION, "display": True, "isReordered": True,
               "deleted": False, "isGenerated": False}
    cards = [{"uuid": f"grpo-{key.replace('/', '-')}", "type": "LINE", "runsCountToCompare": 10,
              "metricSectionId": section["uuid"], "deleted": False, "isGenerated": False, "displayName": key,
              "metricKey": key, "selectedMetricKeys": [key], "lineSmoothness": 0, "xAxisScaleType": "linear",
              "scaleType": "linear", "range": {}, "xAxisKey": "step", "selectedXAxisMetricKey": "",
              "yAxisKey": "METRIC", "yAxisExpressions": [], "ignoreOutliers": False, "useGlobalXaxisKey": True,
              "useGlobalLineSmoothing": True} for key in HEADLINE_METRICS]
    state = {"compareRunCharts": cards, "compareRunSections": [section], "isAccordionReordered": True,
             "hideEmptyCharts": True, "autoRefreshEnabled": True,
             "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""}}
    return json.dumps({"name": "GRPO: reward and validation first", "createdAt": created_ms,
                       "updatedAt": created_ms, "state": json.dumps(state)})


def chart_view_path(experiment_id: str) -> str:
    """The UI route of the experiment's chart view with our saved view (after the UI's base URL and '#')."""
    return f"/experiments/{experiment_id}/runs?viewStateShareKey={CHART_VIEW_ID}&compareRunsMode=CHART"


def default_artifact_location(tracking_uri: str) -> str | None:
    """sqlite stores: artifacts next to the db (else MLflow would use ./mlruns in the cwd)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri[len("sqlite:///") :])
    return (db.parent / "mlartifacts").resolve().as_uri()


def open_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    """The experiment's id, creating it if missing (tolerates a concurrent create): artifacts beside a sqlite store,
    our experiment kind and chart view as tags. A run's tracker and a sweep's parent run both open it here."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        if EXPERIMENT_KIND[0] not in found.tags:  # made by an older version or by hand: opened as GenAI
            client.set_experiment_tag(found.experiment_id, *EXPERIMENT_KIND)
        if CHART_VIEW_TAG not in found.tags:  # a user's edit of the view (same id) is kept
            client.set_experiment_tag(found.experiment_id, CHART_VIEW_TAG, chart_view(int(time.time() * 1000)))
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=default_artifact_location(tracking_uri),
                                        tags={EXPERIMENT_KIND[0]: EXPERIMENT_KIND[1],
                                              CHART_VIEW_TAG: chart_view(int(time.time() * 1000))})
    except MlflowException:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


class Tracker:
    """One MLflow run of one GRPO job: params, buffered metrics, artifacts, tags."""

    def __init__(
        self,
        spec: RunSpec,
        tracking_uri: str,
        run_dir: Path,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        buffer_until_commit: bool = True,
        diverges_after: int | None = None,
    ) -> None:
        """`diverges_after`: a resume's checkpoint step; steps past it that the run holds belong to a trajectory the
        resume leaves (committed by a start with checkpoint.enabled=false, or a newer checkpoint's that was not used)."""
        # no mlflow.set_tracking_uri: it exports MLFLOW_TRACKING_URI into this process, which the next run of an
        # in-process sweep would then read as the user's (tracking/store.py); the client carries its own URI
        self.spec = spec
        self.run_dir = Path(run_dir)
        self.buffer_until_commit = buffer_until_commit
        self.client = MlflowClient(tracking_uri=tracking_uri)
        quiet_store_tracebacks()  # a locked sqlite store: our one-line warning, not MLflow's logged traceback
        self.tracking_uri = tracking_uri
        if tracking_uri.startswith(("http://", "https://")):
            os.environ.setdefault(HTTP_RETRIES_ENV, HTTP_RETRIES)
            os.environ.setdefault(HTTP_TIMEOUT_ENV, HTTP_TIMEOUT)
        self._away: str | None = None  # the error of the store's current outage
        self._warned = 0  # metric values held at its last warning
        self.experiment_id = open_experiment(self.client, spec.logging.experiment, tracking_uri)
        self._buffer: list[Metric] = []
        self._logged: set[tuple[str, int]] = set()  # (key, step) pairs MLflow holds for this run
        self._closed = False
        self.adopted_from: str | None = None  # a checkpoint's run that belongs elsewhere: this run is new
        self._run_id = self._reopen(run_id, parent_run_id, diverges_after) if run_id else self._start(parent_run_id)

    # ------------------------------------------------------------------ set-up --
    def _reopen(self, run_id: str, parent_run_id: str | None = None, diverges_after: int | None = None) -> str:
        """Resume: the same run, marked RUNNING again (params are immutable in MLflow, so not re-logged), when it is
        this run dir's and holds no step of an abandoned trajectory; else a new run, said so (the other run is not
        touched: MLflow cannot take a logged value back, and a step logged twice would show both)."""
        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return self._start_instead(run_id, f"is not in the store {redact_value(self.tracking_uri)}",
                                       parent_run_id)
        elsewhere = self._owner_mismatch(run)
        if elsewhere:
            return self._start_instead(run_id, elsewhere, parent_run_id)
        for key in run.data.metrics:  # what a previous start already committed: never sent twice
            self._logged.update((key, m.step) for m in self.client.get_metric_history(run_id, key))
        ahead = max((step for _, step in self._logged), default=0)
        if diverges_after is not None and ahead > diverges_after:
            self._logged.clear()
            new = self._start(parent_run_id)
            self.adopted_from = run_id
            self.client.set_tag(run_id, "grpo.continued_in", new)
            print(f"grpo-launcher: MLflow run {run_id} holds steps {diverges_after + 1}..{ahead} of the trajectory "
                  f"this resume leaves (it trains on from its checkpoint of step {diverges_after}): that run is "
                  f"left as it was; this run logs to a new MLflow run {new} (steps 1..{diverges_after} copied from "
                  "metrics.jsonl)", flush=True)
            return new
        if run.info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        return run_id

    def _owner_mismatch(self, run: Any) -> str | None:
        """None when `run` was started for this run dir and run name (its RUN_DIR_TAG and run name), else where
        it belongs."""
        where = run.data.tags.get(RUN_DIR_TAG)
        if where is None:
            return f"records no run dir (tag {RUN_DIR_TAG})"
        if Path(where).resolve() != self.run_dir.resolve() or run.info.run_name != self.spec.name:
            return f"belongs to run '{run.info.run_name}' in {where}"
        return None

    def _start_instead(self, run_id: str, why: str, parent_run_id: str | None) -> str:
        new = self._start(parent_run_id)
        self.adopted_from = run_id
        print(f"grpo-launcher: the checkpoint's MLflow run {run_id} {why}, not to this run dir {self.run_dir} "
              f"(a copy?): it is left as it was; this run logs to a new MLflow run {new}", flush=True)
        return new

    def backfill(self, metrics_jsonl: Path) -> int:
        """A new run for a resumed run dir (`adopted_from`): its steps so far, from RUN_DIR/metrics.jsonl, so that the
        step axis holds every step once. Returns how many values were sent."""
        if not Path(metrics_jsonl).is_file():
            return 0
        now = int(time.time() * 1000)
        for line in Path(metrics_jsonl).read_text().splitlines():
            try:
                row = json.loads(line)
                step = int(row.pop("step"))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            self._buffer.extend(Metric(k, float(v), now, step) for k, v in row.items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool))
        return self.commit()

    def _start(self, parent_run_id: str | None) -> str:
        """A new run named spec.name: params, git commit, run dir and the resolved spec.yaml."""
        tags = {RUN_DIR_TAG: str(self.run_dir.resolve()), "mlflow.note.content": RUN_NOTE}
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        commit = git_commit()
        if commit:
            tags["mlflow.source.git.commit"] = commit
        run = self.client.create_run(self.experiment_id, tags=tags, run_name=self.spec.name)
        run_id = run.info.run_id
        params = [Param(k, v) for k, v in flat_params(spec_as_dict(self.spec)).items()]
        for part in chunks(params, MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=part)
        self._log_text(run_id, redact_text(spec_to_yaml(self.spec)), "spec.yaml")
        return run_id

    def _log_text(self, run_id: str, text: str, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(text)
            self.client.log_artifact(run_id, str(path))

    # ----------------------------------------------------------------- metrics --
    @property
    def run_id(self) -> str:
        return self._run_id

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Buffer (or, with buffer_until_commit=False, send) one step's metrics."""
        now = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), now, int(step)) for k, v in metrics.items())
        if not self.buffer_until_commit:
            self.commit()

    def commit(self) -> int:
        """Send the buffered metrics (log_batch, ≤1000 per call), minus (key, step) pairs MLflow already has
        (a step redone after a resume from an older checkpoint). Returns how many were sent. A store that cannot
        be reached keeps the rest buffered, with a warning (once per outage)."""
        buffered, self._buffer = self._buffer, []
        todo, seen = [], set()
        for m in buffered:
            if (m.key, m.step) not in self._logged and (m.key, m.step) not in seen:
                seen.add((m.key, m.step))
                todo.append(m)
        sent = 0
        try:
            for part in chunks(todo, MAX_METRICS_PER_BATCH):
                self.client.log_batch(self._run_id, metrics=part)
                self._logged.update((m.key, m.step) for m in part)
                sent += len(part)
        except UNREACHABLE as exc:
            self._buffer = list(todo[sent:])
            self._went_away(exc)
            return sent
        if self._away is not None and sent:  # nothing sent (nothing buffered): no sign the store is back
            print(f"grpo-launcher: MLflow store {redact_value(self.tracking_uri)} is back: sent {sent} buffered "
                  "metric value(s)", flush=True)
            self._away = None
        return sent

    def _went_away(self, exc: BaseException) -> None:
        """A warning per failed commit that holds more than the last one (not per retry of the end of the run); the
        first of an outage says why (the cause's last words: 'refused')."""
        first = self._away is None
        if not first and len(self._buffer) == self._warned:
            return
        self._warned = len(self._buffer)
        lines = redact_text(str(exc)).strip().splitlines() or [""]
        text = next((line for line in lines if CORRUPT_STORE.search(line)), lines[0])  # else the first line says it
        self._away = f"{type(exc).__name__}: {text[:120]}{' ... ' + text[-120:] if len(text) > 240 else text[120:]}"
        steps = sorted({m.step for m in self._buffer})
        held = (f" (step {steps[0]})" if len(steps) == 1 else f" (steps {steps[0]}..{steps[-1]})") if steps else ""
        how = "damaged: move it aside (MLflow makes a new one)" if self.store_damaged() else "unreachable"
        print(f"grpo-launcher: WARNING: MLflow store {redact_value(self.tracking_uri)} {how}"
              + (f" ({self._away})" if first else "") + f"; {len(self._buffer)} metric value(s){held} kept, "
              f"sent at the next checkpoint (all are in {self.run_dir / 'metrics.jsonl'})", file=sys.stderr,
              flush=True)

    def store_damaged(self) -> bool:
        """The store's last error says its sqlite file is damaged: retries never succeed."""
        return self._away is not None and CORRUPT_STORE.search(self._away) is not None

    def pending(self) -> list[list]:
        """The buffered (uncommitted) metrics as [key, value, timestamp_ms, step] (kept in the checkpoint)."""
        return [[m.key, m.value, m.timestamp, m.step] for m in self._buffer]

    def replay(self, pending: list) -> int:
        """Commit a checkpoint's `pending()` metrics that never reached MLflow (crash after the checkpoint
        became visible, before its commit). Returns how many were sent."""
        self._buffer = [Metric(str(k), float(v), int(ts), int(step)) for k, v, ts, step in pending] + self._buffer
        return self.commit()

    def discard(self) -> int:
        """Drop uncommitted metrics (steps a resume will redo). Returns how many were dropped."""
        dropped, self._buffer = len(self._buffer), []
        return dropped

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        """[(step, value)] of a committed metric, by step."""
        history = self.client.get_metric_history(self._run_id, key)
        return [(m.step, m.value) for m in sorted(history, key=lambda m: (m.step, m.timestamp))]

    # ---------------------------------------------------------- tags/artifacts --
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """A file, or a directory (logged under its own name unless artifact_path is given)."""
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self._run_id, str(path), artifact_path or path.name)
        else:
            self.client.log_artifact(self._run_id, str(path), artifact_path)

    def set_tag(self, key: str, value: Any) -> None:
        """A tag; with the store away (a hang or a dead actor being reported), a warning instead of a second error."""
        try:
            self.client.set_tag(self._run_id, key, str(value))
        except UNREACHABLE as exc:
            self._went_away(exc)

    def log_spec_changes(self, step: int, changes: dict[str, tuple[Any, Any]]) -> None:
        """Keys changed on a resume (params are immutable in MLflow): a param `KEY/from_step_N` per key and the tag
        `grpo.spec_change/from_step_N`. A second resume from the same step keeps the first (the run dir has both)."""
        text = ", ".join(f"{k} {old!r} → {new!r}" for k, (old, new) in changes.items())
        params = [Param(f"{k}/from_step_{step}", param_value(new)) for k, (_, new) in changes.items()]
        try:
            for part in chunks(params, MAX_PARAMS_PER_BATCH):
                self.client.log_batch(self._run_id, params=part)
            self.set_tag(f"grpo.spec_change/from_step_{step}", text[:5000])
        except MlflowException as exc:
            print(f"grpo-launcher: MLflow kept the earlier spec change of step {step}: {exc}"[:300], flush=True)

    def close(self, status: str = "FINISHED") -> None:
        """Commit, then end the run. After a crash you mean to resume, call discard() before close("FAILED")."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        if self._closed:
            return
        if status == "FAILED" and not self._buffer and self._away is not None:  # an abort (a second Ctrl-C, a crash)
            print(f"grpo-launcher: MLflow run {self._run_id} left RUNNING: its store is away ({self._away[:160]}); "
                  "a resume reopens it", file=sys.stderr, flush=True)  # was: up to CLOSE_WAIT_S + HTTP retries
            self._closed = True
            return
        deadline = time.monotonic() + CLOSE_WAIT_S
        while True:
            self.commit()
            try:
                if not self._buffer:
                    self.client.set_terminated(self._run_id, status=status)
                    self._closed = True
                    return
            except UNREACHABLE as exc:
                self._went_away(exc)
            if time.monotonic() >= deadline or self.store_damaged():
                break
            time.sleep(CLOSE_RETRY_S)  # the store is away: wait for it, up to CLOSE_WAIT_S
        why = "is damaged" if self.store_damaged() else f"stayed unreachable for {CLOSE_WAIT_S:.0f} s"
        print(f"grpo-launcher: WARNING: MLflow run {self._run_id} not closed: its store {why}; "
              f"{len(self._buffer)} metric value(s) not sent (all are in {self.run_dir / 'metrics.jsonl'})",
              file=sys.stderr, flush=True)
        self._closed = True
