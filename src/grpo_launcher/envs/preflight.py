"""Pre-flight for what a user brings to the env section: the Env class, the data files, the reward functions
and the prompts (length under the chat template). Each problem is a Violation naming the key and the file
(and line); called by the `env_data_and_code` rule in envs/rules.py before anything is started.

The data is read once per pre-flight (the verdict is kept for the same spec and files: a dry run's second
pass, real_launch_problems, reuses it); a file over PROGRESS_BYTES says what it is doing on stderr. Each reward
function is called on the first REWARD_PROBE_ROWS rows (the row's answer as the completion): a NaN, a string or
(env.reward_errors=raise) an exception is a config error here, not after Ray's start-up. It is then called on every
row of the train and val files (within ANSWER_CHECK_BUDGET_S): rows whose own answer scores 0 can never be
rewarded, and are a warning naming them (file:line). User code (imports, these calls) runs under a time limit
(usercode.call_with_limit, GRPO_USER_CODE_TIMEOUT_S): one that never returns is a config error naming the key.

Prompt lengths, as the model gets them (chat template, env.system_prompt): a data set's rows (train and val, every
validation) are each counted, a row over env.max_prompt_tokens named by file and line. env=toy generates its
prompts: they are counted in the pre-flight of a launch that trains (launch.py run and its dry run, rerun, a sweep's
points: launch/preflight.py sets training_preflight()), not for `launch.py generate` (its --prompt texts set the
budget) nor `eval`; a run over the budget would otherwise stop at step 1 (prompting.PromptTooLong).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import sys
import time
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator

from ..models.tiny import build_tokenizer
from ..spec.errors import Violation
from ..spec.schema import ClusterKind, Resume, RunSpec, validation_on
from . import ENVS, PLANNED_ONLY, env_class
from . import rewards as R
from .dataset import DataError, DatasetEnv, answer_text, load_split
from .math import gold_text, math_verify_match, not_math
from .prompting import prompt_lengths, templating_on
from .toy import ReverseDigitsEnv, every_prompt_text
from .usercode import (LIMIT_ENV, TimeLimitExceeded, UserCodeError, UserCodeTimeout, call_with_limit, describe,
                       is_file_ref, is_ref, load_ref, split_ref, user_code_limit_s)

RULE = "env_data_and_code"
PROGRESS_BYTES = 8 * 2**20  # a data file this large says what pre-flight is doing with it
REWARD_PROBE_ROWS = 3
ANSWER_CHECK_BUDGET_S = 10.0  # calling the reward on every row's own answer stops after this long (said so)
SHOWN_ROWS = 5  # rows named in the warning; the rest are counted
_WARNED: set[str] = set()  # warnings printed by this process (a second pre-flight pass prints none again)
_CHECKED: dict[tuple, list[Violation]] = {}  # (spec, data files' stats) → the verdict
_READ: dict[tuple, Any] = {}  # (split, file stats, keys) → its Table or DataError: read once per pre-flight
_LENGTHS: dict[tuple, list[int]] = {}  # (split, file stats, how prompts are rendered) → each prompt's tokens
_REWARDED: dict[tuple, list[Violation]] = {}  # (reward fn, data files' stats, env keys) → its verdict
_TOY_LONGEST: dict[tuple, int] = {}  # (model.path, how prompts are rendered) → env=toy's longest
RAW_TOY_TOKENS = 8  # '4821>' as raw text: ≤ 5 pieces + a leading-space piece + BOS/EOS, with any tokenizer
_TRAINING: ContextVar[bool] = ContextVar("grpo_launcher_training_preflight", default=False)


def V(keys: str | tuple[str, ...], message: str, fix: str) -> Violation:  # noqa: N802
    keys = (keys,) if isinstance(keys, str) else keys
    for prefix in (f"{keys[0]}: ", f"{keys[0]}="):  # the key is shown in front already
        if message.startswith(prefix) and prefix.endswith(": "):
            message = message[len(prefix):]
    return Violation(RULE, keys, message, fix)


def here(s: RunSpec, path: str | None) -> bool:
    """Whether a path can be checked from this machine (a Slurm job's may live on the cluster only)."""
    return bool(path) and (s.cluster.kind == ClusterKind.local or Path(path).expanduser().exists())


@contextmanager
def training_preflight() -> Iterator[None]:
    """Pre-flight of a launch that trains (launch/preflight.py: run, rerun, a sweep's points) or scores the env's
    own prompts (eval): the prompts an env generates (env=toy's) are counted too. Outside it (load_spec: generate,
    a test's spec) they are not: generate fits the budget to its own --prompt texts."""
    token = _TRAINING.set(True)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def check_env(s: RunSpec) -> Iterator[Violation]:
    """Every problem of the env section (kept per spec and data files: the data is read once)."""
    key = (repr(dataclasses.replace(s, dry_run=False)), *(_stat(getattr(s.env, f"{w}_path")) for w in data_splits(s)))
    if key not in _CHECKED:
        _CHECKED.clear()
        _CHECKED[key] = list(_check_env(s))
    yield from _CHECKED[key]
    if _TRAINING.get() and ENVS.get(s.env.name) is ReverseDigitsEnv:
        yield from check_toy_prompts(s)


def _stat(path: str | None) -> tuple:
    try:
        st = Path(path).expanduser().stat() if path else None
    except OSError:
        return (path,)
    return (path, st.st_mtime_ns, st.st_size) if st else (path,)


@contextmanager
def progress(what: Any, done: str) -> Iterator[None]:
    """'pre-flight: reading big.jsonl (14 MiB) ...', then 'big.jsonl: read in 2.1 s' (a Table: 'big.jsonl: 200000 rows:
    prompt tokens counted in 3.0 s') on stderr, for a file over PROGRESS_BYTES."""
    path = Path(getattr(what, "path", what)).expanduser()
    big = path.is_file() and path.stat().st_size > PROGRESS_BYTES
    if big and not hasattr(what, "rows"):
        print(f"grpo-launcher: pre-flight: reading {path} ({path.stat().st_size / 2**20:.0f} MiB) ...",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    yield
    if big:
        rows = f"{len(what.rows)} rows: " if hasattr(what, "rows") else ""
        print(f"grpo-launcher: pre-flight: {path.name}: {rows}{done} in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)


def _check_env(s: RunSpec) -> Iterator[Violation]:
    e = s.env
    if e.name not in ENVS and e.name not in PLANNED_ONLY and not is_ref(e.name):
        yield V("env.name", f"env.name={e.name!r} is neither a built-in env nor a 'module:Class' reference",
                f"use one of {', '.join([*ENVS, *PLANNED_ONLY])}, or package.module:Class / path/to/envs.py:Class")
        return
    if e.name in PLANNED_ONLY:
        return
    if is_ref(e.name) and not _code_here(s, e.name):
        return
    try:
        cls = env_class(e.name)
    except UserCodeError as exc:
        yield V("env.name", str(exc), _import_fix(exc, "fix the module/file and the class name (module:Class)"))
        return
    if cls not in ENVS.values():
        yield from _check_constructor(cls, s)
    yield from _check_rewards_declared(s, cls)
    if isinstance(cls, type) and issubclass(cls, DatasetEnv):
        yield from check_dataset(s, cls)


def check_toy_prompts(s: RunSpec) -> Iterator[Violation]:
    """env=toy, in a launch that trains: every prompt it can give ('4821>'), as the model gets it, fits
    env.max_prompt_tokens (8). A chat template or env.system_prompt adds tens of tokens: unchecked, the run stopped
    at step 1 (PromptTooLong), after its start-up. No tokenizer is loaded when the raw prompts fit any tokenizer."""
    e = s.env
    if not _toy_count_needed(s):
        return
    tok = load_tokenizer(s)
    if tok is None:
        return  # the model rules name an unreadable tokenizer
    if e.chat_template and not getattr(tok, "chat_template", None):
        yield _no_template(s)
        return
    longest = toy_longest(s, tok)
    if longest <= e.max_prompt_tokens:
        return
    on = templating_on(tok, e)
    plain = toy_longest(dataclasses.replace(s, env=dataclasses.replace(e, chat_template=False)), tok) if on else longest
    why, key = ((f"the chat template of {s.model.path}", "model.path") if on else
                ("env.system_prompt before each", "env.system_prompt") if e.system_prompt else
                (f"the tokenizer of {s.model.path or 'the tiny model'}", None))
    need = longest + s.rollout.max_new_tokens
    total = f" train.max_total_sequence_length={need}" if need > s.train.max_total_sequence_length else ""
    other = ([f"env.chat_template=false ({plain} tokens without it)"] if on and plain <= e.max_prompt_tokens else []) \
        + (["env.system_prompt=null"] if e.system_prompt and not on else [])
    yield V(("env.max_prompt_tokens", *([key] if key else [])),
            f"env=toy's prompts ('4821>') are up to {longest} tokens as the model gets them ({why}), over "
            f"env.max_prompt_tokens={e.max_prompt_tokens}: the run would stop at step 1",
            f"set env.max_prompt_tokens={longest}{total}" + "".join(f", or {o}" for o in other))


def _toy_count_needed(s: RunSpec) -> bool:
    """Whether env=toy's prompts could exceed the budget: a template (on, or declared by model.path's files: read as
    files, no tokenizer loaded), a system prompt, or a budget under what raw '4821>' takes with any tokenizer."""
    e = s.env
    if e.system_prompt or e.max_prompt_tokens < RAW_TOY_TOKENS or e.chat_template:
        return True
    if e.chat_template is False or not s.model.path or not here(s, s.model.path):
        return False
    d = Path(s.model.path).expanduser()
    try:
        declared = "chat_template" in (d / "tokenizer_config.json").read_text(encoding="utf-8", errors="replace")
    except OSError:
        declared = False
    return declared or any((d / f).exists() for f in ("chat_template.jinja", "chat_template.json",
                                                      "additional_chat_templates"))


def toy_longest(s: RunSpec, tok: Any) -> int:
    """The longest of env=toy's 10^4 prompts as the model gets them, once per tokenizer and rendering (a long
    env.system_prompt is tokenised once, not with each prompt: prompting.shared_head_lengths; 62 s of CPU -> 2.4 s
    for the dry run at 4,000 characters). check_toy_prompts asks again with env.chat_template=false only to word
    its fix, when the prompts are over the budget under a template."""
    e = s.env
    key = (s.model.path, e.chat_template, e.system_prompt)
    if key not in _TOY_LONGEST:
        _TOY_LONGEST[key] = max(prompt_lengths(tok, every_prompt_text(), e))
    return _TOY_LONGEST[key]


def _no_template(s: RunSpec) -> Violation:
    return V("env.chat_template", f"env.chat_template=true but the tokenizer of {s.model.path or 'the tiny model'} "
             "has no chat template", "set env.chat_template=false (raw prompts), or use a tokenizer with a chat_template")


def _import_fix(exc: UserCodeError, fix: str) -> str:
    if isinstance(exc, UserCodeTimeout):
        return f"do the slow work on first use, not at import; or raise the limit: {LIMIT_ENV}=SECONDS"
    return fix


def _code_here(s: RunSpec, ref: str) -> bool:
    head, _ = split_ref(ref)
    return not is_file_ref(head) or here(s, head)


def _check_constructor(cls: type, s: RunSpec) -> Iterator[Violation]:
    try:
        inspect.signature(cls).bind(s.env, seed=s.grpo.seed)
    except TypeError as exc:
        yield V("env.name", f"{describe(cls)} cannot be constructed as {cls.__name__}(env_spec, seed=...): {exc}",
                "give the class __init__(self, spec, seed=0) (spec is the run's env section)")
    except ValueError:
        pass


def _check_rewards_declared(s: RunSpec, cls: type) -> Iterator[Violation]:
    e = s.env
    n = len(e.reward_fns)
    if e.reward_weights and len(e.reward_weights) != n:
        yield V(("env.reward_weights", "env.reward_fns"),
                f"{len(e.reward_weights)} weight(s) for {n} reward functions",
                "give one weight per env.reward_fns entry (or none: all 1.0)")
    if (e.reward_fn or e.reward_fns) and cls is ReverseDigitsEnv:
        yield V("env.reward_fn", f"env={e.name} has its own scorer and ignores reward functions",
                "use env=dataset (your files) or env=math with env.reward_fn / env.reward_fns")


def check_dataset(s: RunSpec, cls: type) -> Iterator[Violation]:
    e = s.env
    fns: list = []
    default = [("env.reward_fn", cls.DEFAULT_REWARD, 1.0)] if cls.DEFAULT_REWARD else []
    refs = R.reward_refs(e) or default
    for key, ref, weight in refs:  # each named on its own: every broken one is reported
        head, _ = split_ref(ref) if is_ref(ref) else (ref, "")
        if is_ref(ref) and is_file_ref(head) and not here(s, head):
            continue  # a Slurm job's file, on the cluster only
        try:
            fn = load_ref(ref, key)
        except UserCodeError as exc:
            yield V(key, str(exc), _import_fix(exc, "point it at a function: package.module:function or "
                                                   "path/to/rewards.py:function"))
            continue
        if not callable(fn):
            yield V(key, f"{key}={ref}: {fn!r} is not callable", "point it at a function")
            continue
        fns.append(R.Reward(ref, fn, weight, key))
    if not R.reward_refs(e) and not e.answer_key:
        yield V("env.reward_fn", f"env={e.name} has no answer column (env.answer_key=null) and no reward function",
                "set env.reward_fn=path/to/rewards.py:function")
    if e.answer_key and e.answer_key == e.prompt_key:
        yield V(("env.answer_key", "env.prompt_key"), f"env.prompt_key and env.answer_key are both {e.prompt_key!r}: "
                "the model would be shown the answer in its prompt", "name the question's column in env.prompt_key")
    tables = {}
    for which in data_splits(s):
        path = getattr(e, f"{which}_path")
        if not path:
            yield V(f"env.{which}_path", f"env={e.name} reads its prompts from files, and env.{which}_path is null"
                    + (f" ({_validating(s.grpo)})" if which == "val" else ""),
                    f"set env.{which}_path to a data file (.jsonl, .json, .csv, .tsv, gzip'ed or not; .parquet) or a "
                    "saved datasets directory" + (" of held-out rows, or turn validation off: grpo.val_period=0 "
                                                  "grpo.val_at_start=false grpo.val_at_end=false" if which == "val"
                                                  else ""))
            continue
        if not Path(path).expanduser().exists():
            continue  # local_paths_exist names it (local runs); a Slurm job's file may live on the cluster
        try:
            tables[which] = read_split(e, which)
        except DataError as exc:
            yield V(f"env.{which}_path", str(exc), _data_fix(str(exc)))
    if fns and "train" in tables:
        columns = sorted({k for r in tables["train"].rows for k in R.row_kwargs(r, e.prompt_key)})
        for r in fns:
            yield from reward_verdict(s, r, tables, columns)
    if "train" in tables:
        yield from _check_epochs(s, len(tables["train"].rows))
        warn_of_repeats(e, tables)
        warn_of_hidden_columns(e, tables["train"])
        if not R.reward_refs(e) and getattr(cls, "DEFAULT_REWARD", None) == DatasetEnv.DEFAULT_REWARD and e.answer_key:
            warn_of_solutions(e, tables["train"])
    if tables:
        yield from check_prompts(s, tables)


def data_splits(s: RunSpec) -> tuple[str, ...]:
    """The splits a run reads: train, and val when it validates (spec.schema.validation_on)."""
    return ("train", "val") if validation_on(s.grpo) else ("train",)


def _validating(grpo: Any) -> str:
    on = [f"grpo.val_period={grpo.val_period}"] if grpo.val_period > 0 else []
    on += [f"grpo.{k}=true" for k in ("val_at_start", "val_at_end") if getattr(grpo, k)]
    return "validation is on: " + ", ".join(on)


def reward_verdict(s: RunSpec, r: Any, tables: dict, columns: list[str]) -> list[Violation]:
    """A reward function's signature, probe and answer check, once per (function, data files, the env keys they
    read): a sweep's points share it (the verdict does not depend on the rest of the spec)."""
    e = s.env
    key = (r.ref, r.key, _code_stat(r.ref), tuple(columns), e.name, e.prompt_key, e.answer_key, e.reward_errors.value,
           user_code_limit_s(), *(_stat(getattr(e, f"{w}_path")) for w in tables))
    if key not in _REWARDED:
        if len(_REWARDED) > 32:
            _REWARDED.clear()
        _REWARDED[key] = list(_reward_verdict(s, r, tables, columns))
    return _REWARDED[key]


def _code_stat(ref: str) -> tuple:
    head = split_ref(ref)[0] if is_ref(ref) else ""
    return _stat(head) if head and is_file_ref(head) else ()


def _reward_verdict(s: RunSpec, r: Any, tables: dict, columns: list[str]) -> Iterator[Violation]:
    problem = R.signature_problem(r.fn, columns)
    if problem:
        yield V(r.key, problem, "def fn(prompt, completion, **kwargs) -> float")
        return
    bad = list(_probe_reward(s, r, tables["train"]))
    yield from bad
    if not bad and s.env.answer_key:
        yield from _check_answers_score(s, r, tables)


def _probe_reward(s: RunSpec, r: Any, table: Any) -> Iterator[Violation]:
    """Call the reward function on the first rows, the answer as the completion: its return must be a finite float
    (an exception too is a config error unless env.reward_errors=zero)."""
    e = s.env
    for i in range(min(REWARD_PROBE_ROWS, len(table.rows))):
        row = table.rows[i]
        completion = answer_text(row[e.answer_key]) if e.answer_key else ""
        try:
            call_with_limit(user_code_limit_s(), R.score, [r], row[e.prompt_key], completion, row, e.prompt_key,
                            table.where(i))
        except TimeLimitExceeded as exc:
            yield _timed_out(r, exc, table.where(i))
            return
        except R.UserCodeError as exc:
            if "raised" in str(exc).split("\n")[0] and e.reward_errors.value == "zero":
                continue  # scored 0 and counted at run time
            yield V(r.key, f"{exc}\n      (called at pre-flight with the row's answer as the completion)",
                    "return a finite float from every call (float(...); NaN is not a reward)"
                    + ("" if e.reward_errors.value == "zero" else ", or env.reward_errors=zero to score 0 when it "
                       "raises"))
            return


def _timed_out(r: Any, exc: TimeLimitExceeded, where: str) -> Violation:
    return V(r.key, f"{r.key}={r.ref}: the reward function {describe(r.fn)} did not return within {exc.seconds:g} s "
             f"(called at pre-flight on the row at {where}, with the row's answer as the completion)",
             f"make it return (it is called once per sample), or raise the limit: {LIMIT_ENV}=SECONDS")


def _check_answers_score(s: RunSpec, r: Any, tables: dict) -> Iterator[Violation]:
    """Call the reward on every row with the row's own answer as the completion, as written, then boxed and in $..$
    (answer_forms; within ANSWER_CHECK_BUDGET_S): rows that no form scores can never be rewarded: one warning naming
    the first SHOWN_ROWS (file:line) and counting the rest. Under math_verify_match, rows whose answer is no math to
    the grader (math.not_math: n/a, words) are a warning too. A call that does not return is a config error."""
    e, zero, text_only, checked = s.env, [], [], 0
    files: list = []  # env.val_path = env.train_path: its rows counted once
    for t in tables.values():
        if not any(f.path == t.path and f.rows == t.rows for f in files):
            files.append(t)
    total = sum(len(t.rows) for t in files)
    deadline = time.monotonic() + ANSWER_CHECK_BUDGET_S
    for t in files:
        for i, row in enumerate(t.rows):
            if time.monotonic() > deadline:
                break
            value = row[e.answer_key]
            try:
                for completion in answer_forms(value):  # until one is rewarded
                    got = call_with_limit(user_code_limit_s(), R.score, [r], row[e.prompt_key], completion, row,
                                          e.prompt_key, t.where(i), on_error="zero")
                    if got.total != 0:
                        break
            except TimeLimitExceeded as exc:
                yield _timed_out(r, exc, t.where(i))
                return
            checked += 1
            answer = answer_text(value)
            if got.total == 0:
                zero.append(f"{t.where(i)}: answer {_short(answer)}" + (" (the call raised)" if got.error else ""))
            elif r.fn is math_verify_match and not_math(gold_text(value)):
                text_only.append(f"{t.where(i)}: answer {_short(answer)}")
    if zero:
        warn(_unrewardable_text(r, zero, checked, total))
    if text_only:
        warn(_text_only_text(r, text_only, checked, total))


def answer_forms(value: Any) -> list[str]:
    """The completions a row's own answer is tried as: its text, (a list cell: [1, 2]) as the grader reads the cell
    ($1, 2$; its JSON text `[1, 2]` is an interval to math-verify), then in \\boxed{} and in $..$ as a model writes
    it (`A`, `x^2` score 0 as a whole completion: math-verify reads a bare answer only when it is a number)."""
    text = answer_text(value)
    gold = (gold_text(value) if isinstance(value, list) else text).strip()
    inner = gold[1:-1] if len(gold) > 1 and gold[0] == gold[-1] == "$" else gold
    return list(dict.fromkeys([text, gold, f"\\boxed{{{inner}}}", f"${inner}$"]))


def _unrewardable_text(r: Any, zero: list[str], checked: int, total: int) -> str:
    of = f"{checked} rows checked of {total} (pre-flight's {ANSWER_CHECK_BUDGET_S:g} s)" if checked < total \
        else f"{total} rows"
    every = len(zero) == checked
    head = (f"{r.key} ({r.ref}) scores 0 on {'every one' if every else len(zero)} of {of} when the completion is "
            f"the row's own answer (as written, in \\boxed{{}} or in $..$): {'they' if every else 'those rows'} can "
            "never be rewarded")
    shown = [f"    {z}" for z in zero[:SHOWN_ROWS]]
    more = [f"    ... and {len(zero) - SHOWN_ROWS} more"] if len(zero) > SHOWN_ROWS else []
    hint = ("  (if the reward expects more than the bare answer, e.g. a format, this is expected)" if every else
            "  (check those answers: a grader reads them as it reads a completion)")
    return "\n".join([head, *shown, *more, hint])


def _text_only_text(r: Any, rows: list[str], checked: int, total: int) -> str:
    of = f"{checked} rows checked of {total}" if checked < total else f"{total} rows"
    shown = [f"    {z}" for z in rows[:SHOWN_ROWS]]
    more = [f"    ... and {len(rows) - SHOWN_ROWS} more"] if len(rows) > SHOWN_ROWS else []
    return "\n".join([f"{r.key} ({r.ref}): {len(rows)} of {of} have an answer that is no math to the grader (a "
                      "placeholder such as n/a or ?, words such as `four`, which math-verify reads as f·o·u·r): only "
                      "a completion with the same text in \\boxed{} is rewarded (\\boxed{four}, not 4)", *shown, *more,
                      "  (fix those answers: a number or an expression)"])


def warn(text: str) -> None:
    """A pre-flight warning on stderr, once per process."""
    if text not in _WARNED:
        _WARNED.add(text)
        print(f"grpo-launcher: warning: {text}", file=sys.stderr, flush=True)


def _short(value: str, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def read_split(e: Any, which: str) -> Any:
    """load_split, once per file version and keys (the prompt budget and the checks share it)."""
    path = getattr(e, f"{which}_path")
    key = (which, _stat(path), e.name, e.prompt_key, e.answer_key)
    if key not in _READ:
        if len(_READ) > 8:
            _READ.clear()
        try:
            with progress(path, "read"):
                _READ[key] = load_split(e, which)
        except UserCodeError as exc:
            _READ[key] = exc
    if isinstance(_READ[key], Exception):
        raise _READ[key]
    return _READ[key]


def split_lengths(s: RunSpec, tok: Any, which: str, table: Any) -> list[int]:
    """Each prompt's token count as the model gets it (chat template, system prompt), once per file version."""
    e = s.env
    key = (which, _stat(getattr(e, f"{which}_path")), e.prompt_key, e.chat_template, e.system_prompt, s.model.path)
    if key not in _LENGTHS:
        if len(_LENGTHS) > 8:
            _LENGTHS.clear()
        with progress(table, "prompt tokens counted"):
            _LENGTHS[key] = prompt_lengths(tok, [r[e.prompt_key] for r in table.rows], e)
    return _LENGTHS[key]


def resolve_prompt_budget(s: RunSpec) -> tuple[RunSpec, list[Violation]]:
    """env.max_prompt_tokens=0 (env=dataset's default): the longest prompt of the train and val files as the model
    gets it. Problems with the files themselves are check_dataset's to name (the budget then stays 0)."""
    e = s.env
    if e.max_prompt_tokens != 0:
        return s, []
    fix = "set env.max_prompt_tokens to the longest prompt's token count"
    try:
        dataset = issubclass(env_class(e.name), DatasetEnv)
    except Exception:  # noqa: BLE001 - an unknown env is check_env's to name
        return s, []
    if not dataset:
        return s, [V("env.max_prompt_tokens", f"env.max_prompt_tokens=0 takes the longest prompt of a data set, and "
                     f"env={e.name} reads none", fix)]
    paths = [p for p in (getattr(e, f"{w}_path") for w in data_splits(s)) if p]
    if any(here(s, p) and not Path(p).expanduser().exists() for p in paths):
        return s, []  # a missing file: check_dataset names it
    if not paths or not all(here(s, p) for p in paths):
        return s, [V("env.max_prompt_tokens", "env.max_prompt_tokens=0 takes the longest prompt of the data, which "
                     "cannot be read from here (a path on the cluster only)", fix)] if paths else []
    tok = load_tokenizer(s)
    if tok is None:
        return s, [V("env.max_prompt_tokens", f"env.max_prompt_tokens=0 counts the data's prompts with the model's "
                     f"tokenizer, which cannot be read from {s.model.path}", fix)]
    longest, where = 0, ""
    try:
        for which in data_splits(s):
            if getattr(e, f"{which}_path"):
                t = read_split(e, which)
                lengths = split_lengths(s, tok, which, t)
                i = max(range(len(lengths)), key=lengths.__getitem__)
                if lengths[i] > longest:
                    longest, where = lengths[i], t.where(i)
    except (DataError, UserCodeError):
        return s, []
    print(f"grpo-launcher: env.max_prompt_tokens={longest}: the longest prompt of the data ({where})", flush=True)
    return dataclasses.replace(s, env=dataclasses.replace(e, max_prompt_tokens=longest)), []


def _data_fix(message: str) -> str:
    if "no rows" in message:
        return "point it at a file with rows"
    if "invalid JSON" in message or "not an object" in message or "must be a JSON" in message:
        return "fix those lines (JSONL: one JSON object per line)"
    if " whose " in message:
        return ('fix those rows\' prompts: a string, or chat messages [{"role": "user", "content": "..."}, ...] '
                "ending with the user's turn")
    if " without " in message or "with an empty" in message or "no row has" in message:
        return "fix those rows (or drop them), or name the right column with env.prompt_key / env.answer_key"
    return "fix the file or point the key at another one"


def warn_of_repeats(e: Any, tables: dict) -> None:
    """Warnings (the run goes on): validation prompts that are also training prompts (its rewards then measure
    recall, not held-out accuracy), and a training prompt given two different answers (one of them is never
    rewarded)."""
    def text(row: dict) -> str:  # a prompt as compared: a string stripped, a message list as its JSON text
        return row[e.prompt_key].strip() if isinstance(row[e.prompt_key], str) else json.dumps(row[e.prompt_key])

    train, key = tables["train"], e.answer_key
    seen: dict[str, int] = {}
    clash = []  # (row, the earlier row with the same prompt)
    for i, row in enumerate(train.rows):
        first = seen.setdefault(text(row), i)
        if key and first != i and answer_text(train.rows[first][key]) != answer_text(row[key]):
            clash.append((i, first))
    if clash:
        shown = [f"{train.where(i)} (answer {_short(answer_text(train.rows[i][key]), 30)}; {train.label(first)}: "
                 f"{_short(answer_text(train.rows[first][key]), 30)})" for i, first in clash[:SHOWN_ROWS]]
        warn(f"{len(clash)} training row(s) repeat an earlier row's prompt with another answer (only one can be "
             f"rewarded): {'; '.join(shown)}{' ...' if len(clash) > SHOWN_ROWS else ''}")
    val = tables.get("val")
    if val is None:
        return
    same = [i for i, row in enumerate(val.rows) if text(row) in seen]
    if same:
        also = " (env.val_path is env.train_path)" if Path(e.val_path).resolve() == Path(e.train_path).resolve() else ""
        warn(f"{len(same)} of {len(val.rows)} validation prompts are also training prompts{also}: validation "
             f"rewards will not measure held-out accuracy; the first at {val.where(same[0])}")


def warn_of_hidden_columns(e: Any, train: Any) -> None:
    """A column the reward functions will not see as the file holds it: `answer` when env.answer_key names another
    column (their `answer` argument is that column), `prompt` / `completion` (the first two arguments: the prompt
    from env.prompt_key and the decoded completion)."""
    hidden = [f"'answer' (the `answer` argument is the {e.answer_key!r} column, env.answer_key)"
              for _ in [0] if e.answer_key not in (None, "answer") and "answer" in train.columns]
    hidden += [f"{c!r} (the `{c}` argument is " + ("the decoded completion)" if c == "completion" else
                                                  f"the {e.prompt_key!r} column, env.prompt_key)")
               for c in R.RESERVED if c in train.columns and c != e.prompt_key]
    if hidden:
        warn(f"{train.path}: the reward functions do not get the file's column {' or '.join(hidden)}; rename the "
             "column to pass it")


def warn_of_solutions(e: Any, train: Any) -> None:
    """env=dataset's default reward (exact match with the answer) on answers that are worked solutions (GSM8K's
    `#### 72`, MATH's `\\boxed{}`): no completion matches a whole solution, every reward would be 0."""
    texts = (answer_text(row[e.answer_key]) for row in train.rows)
    worked = [i for i, text in enumerate(texts) if "####" in text or "\\boxed" in text]
    if len(worked) * 2 > len(train.rows):
        warn(f"{len(worked)} of {len(train.rows)} answers in {train.path} are worked solutions (`####` / `\\boxed`; "
             f"the first at {train.where(worked[0])}), and env={e.name}'s reward compares the whole completion with "
             "the whole answer (exact_match): every reward would be 0; use env=math (graded by the final answer) "
             "or env.reward_fn")


def _check_epochs(s: RunSpec, rows: int) -> Iterator[Violation]:
    e, g = s.env, s.grpo
    if e.epochs is None:
        return
    step, drawn = resumed_draws(s)  # a resume carries on in the data where its checkpoint left it
    want = step + max(-(-(e.epochs * rows - drawn) // g.num_prompts_per_step), 0)  # the last pass may be partial
    if g.max_steps != want:
        have = (drawn + (g.max_steps - step) * g.num_prompts_per_step) / rows
        counted = (f"the checkpoint's {drawn} prompts through step {step} + {g.max_steps - step} more step(s)"
                   if step else f"grpo.max_steps={g.max_steps}")
        yield V(("env.epochs", "grpo.max_steps"),
                f"{counted} × {g.num_prompts_per_step} prompts/step = {have:.2f} epochs of {rows} rows, not "
                f"env.epochs={e.epochs}",
                f"set grpo.max_steps={want} (or env.epochs=null)")


def resumed_draws(s: RunSpec) -> tuple[int, int]:
    """(step, prompts drawn through it) of the checkpoint a launch of this spec resumes ((0, 0): none): with
    another grpo.num_prompts_per_step than the checkpoint's, env.epochs counts the rows already drawn."""
    from ..finished import newest_meta  # here: pre-flight's other rules do not need it

    found = newest_meta(Path(s.output_root) / s.name) if s.checkpoint.resume == Resume.auto else None
    if found is None:
        return 0, 0
    step, meta = found
    try:
        drawn = meta["state"].get("prompts_drawn")  # before it was saved: the checkpoint's own count, throughout
        return step, int(drawn if drawn is not None else step * meta["spec"]["grpo"]["num_prompts_per_step"])
    except (KeyError, TypeError, ValueError, AttributeError):  # a meta.json of another shape: counted from step 0
        return 0, 0


_TOKENIZERS: dict[str | None, Any] = {}


def load_tokenizer(s: RunSpec) -> Any:
    """The run's tokenizer (model.path, or the tiny model's), or None if it cannot be read here; once per path."""
    if s.model.path not in _TOKENIZERS or _TOKENIZERS[s.model.path] is None:
        _TOKENIZERS[s.model.path] = _read_tokenizer(s)
    return _TOKENIZERS[s.model.path]


def _read_tokenizer(s: RunSpec) -> Any:
    try:
        if s.model.path:
            if not Path(s.model.path).expanduser().is_dir():  # a Slurm job's, or none: not read (the model rules
                return None  # name a missing one); AutoTokenizer's import alone takes 5-12 s before it fails
            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # pre-flight never waits on the network
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            from transformers import AutoTokenizer  # here: pre-flight imports this module

            return AutoTokenizer.from_pretrained(s.model.path, local_files_only=True)
        return build_tokenizer()
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is the model rules' to report
        return None


def special_tokens(tok: Any) -> list[str]:
    """The tokenizer's special tokens as text ('<|im_end|>', '<|endoftext|>'), longest first."""
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    found = {*getattr(tok, "all_special_tokens", []), *(t.content for t in added.values() if getattr(t, "special", 0))}
    return sorted((t for t in found if isinstance(t, str) and len(t) > 1), key=len, reverse=True)


def warn_of_special_tokens(s: RunSpec, tok: Any, tables: dict) -> None:
    """Prompts (or env.system_prompt) holding a special token's text: the tokenizer encodes it as that token, not as
    text (`what is <|im_end|>?` gives the model an end of turn, or a whole fake turn, mid-prompt). A warning naming
    the first row (file:line) and the token; the run goes on."""
    specials = special_tokens(tok)
    if not specials:
        return
    pattern = re.compile("|".join(re.escape(t) for t in specials))

    def text(prompt: Any) -> str:
        if isinstance(prompt, str):
            return prompt
        return "\n".join(m["content"] for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))

    if s.env.system_prompt and (m := pattern.search(s.env.system_prompt)):
        warn(f"env.system_prompt holds the text of the special token {m.group(0)!r}: the tokenizer encodes it as "
             "that token, not as text")
    for t in tables.values():
        hits = [(i, m.group(0)) for i, row in enumerate(t.rows) if (m := pattern.search(text(row[s.env.prompt_key])))]
        if hits:
            i, token = hits[0]
            warn(f"{len(hits)} of {len(t.rows)} prompts in {t.path} hold the text of a special token of the tokenizer "
                 f"({token!r} at {t.where(i)}): it is encoded as that token, not as text (an end of turn or a turn of "
                 "its own mid-prompt); remove or escape it in those rows")


def check_prompts(s: RunSpec, tables: dict) -> Iterator[Violation]:
    """Chat template present when asked for; every prompt within env.max_prompt_tokens once templated."""
    e = s.env
    tok = load_tokenizer(s)
    if tok is None:
        return
    if e.chat_template and not getattr(tok, "chat_template", None):
        yield _no_template(s)
        return
    warn_of_special_tokens(s, tok, tables)
    if not templating_on(tok, e) and any(isinstance(r[e.prompt_key], list) for t in tables.values()
                                         for r in t.rows):
        yield V("env.chat_template", "prompts are chat messages but no chat template is applied",
                "set env.chat_template=true with a tokenizer that has a template")
        return
    if e.max_prompt_tokens == 0:  # a budget to be counted from the files, left unresolved: a file's problem is named
        return
    for which, t in tables.items():
        lengths = split_lengths(s, tok, which, t)
        over = [i for i, n in enumerate(lengths) if n > e.max_prompt_tokens]
        if over:
            worst = max(over, key=lambda i: lengths[i])
            yield V(("env.max_prompt_tokens", f"env.{which}_path"),
                    f"{len(over)} of {len(t.rows)} prompts exceed env.max_prompt_tokens={e.max_prompt_tokens}"
                    f"{' (chat template on)' if templating_on(tok, e) else ''}; the longest, {lengths[worst]} tokens, "
                    f"is at {t.where(worst)}",
                    f"set env.max_prompt_tokens={max(lengths)} (and keep + rollout.max_new_tokens ≤ "
                    "train.max_total_sequence_length), or shorten those prompts")
