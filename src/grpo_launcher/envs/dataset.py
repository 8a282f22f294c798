"""env=dataset: prompts from local files or a saved HF `datasets` directory, scored by user reward functions
(env.reward_fn / env.reward_fns, see envs/rewards.py).

    python launch.py env=dataset env.train_path=train.jsonl env.val_path=val.jsonl \
        env.prompt_key=question env.answer_key=answer env.reward_fn=rewards.py:correct

Formats, by the name's suffix (any case): .jsonl / .ndjson (one object per line), .json (a list of objects,
{"data": [objects]}, or JSON Lines under a .json name, as `datasets`' to_json writes them), .csv, .tsv, each
also gzip'ed (.jsonl.gz ...); .parquet; a directory written by save_to_disk (a DatasetDict: its `train` split,
for env.val_path `validation` / `val` / `test`). Anything else is refused by name; a directory of data files (a
hub snapshot) names the files to point at.

Values arrive as the file wrote them: CSV cells are strings ("0487" stays "0487"; an empty cell is ""),
JSONL / JSON values are JSON values (strings, numbers, lists ...), Parquet and saved `datasets` columns keep
their column types. Reward functions get each row's columns as these values; the built-in scorers compare
the answer as text (str of a string, JSON text of any other value). A prompt is a string, or a list of chat
messages [{"role", "content"}, ...] (content parts [{"type": "text", "text"}] are joined into their text); a
string that is the JSON text of such a list (a messages column written to CSV) is parsed into the list.

Every row must hold env.prompt_key (and env.answer_key unless it is null); missing keys, null, empty or NaN
values, malformed lines, a CSV row short of cells, a message list a chat template cannot render as meant (not
{"role", "content"}, ShareGPT's {"from", "value"}, an unknown role, content that is not text, or ending with the
assistant's message: the model would be shown the answer) or an empty file make one DataError naming the file
and every bad line (row, for columnar files), grouped by problem, up to MAX_LISTED lines each ("12 rows with an
empty 'answer' ...: lines 4, 9, ...").
Training order: every row once per epoch, reshuffled each epoch when env.shuffle (seeded by grpo.seed);
dynamic-sampling refills (round > 0) draw at random. The same (step, round) always gives the same prompts.
"""

from __future__ import annotations

import csv
import gzip
import io
import decimal
import json
import math
import random
import zlib
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Optional

from ..spec.schema import EnvSpec
from . import rewards as R
from .base import Prompt, first_position
from .usercode import UserCodeError

JSONL = (".jsonl", ".ndjson")
FORMATS = (".jsonl", ".ndjson", ".json", ".csv", ".tsv")  # each also gzip'ed (.jsonl.gz)
SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
VAL_SPLITS = ("validation", "val", "test")
MAX_LISTED = 20  # bad lines named per problem in a DataError (the count is always the full one)


class DataError(UserCodeError):
    """A data file that cannot be used: the message names the key, the file and the line/row."""


@dataclass
class Table:
    path: Path
    rows: list[dict]
    where: Callable[[int], str]  # row index → "file:line" / "file[row i]"
    columns: list[str]
    label: Callable[[int], str] = str  # row index → "line 4" / "row 3" (lists of bad rows)


def lines_of(problems: list[str]) -> str:
    """One problem on the same line, several each on its own (indented under the config error's key)."""
    return f" {problems[0]}" if len(problems) == 1 else "".join(f"\n      {p}" for p in problems)


def listed(what: str, labels: list[str]) -> str:
    """'12 rows with an empty 'answer': lines 4, 9, ... (the first 20)'."""
    shown = labels[:MAX_LISTED]
    kind, nums = (shown[0].split(" ", 1)[0], [x.split(" ", 1)[-1] for x in shown]) if shown else ("line", [])
    more = f", ... (the first {MAX_LISTED} of {len(labels)})" if len(labels) > MAX_LISTED else ""
    return f"{len(labels)} row{'s' if len(labels) != 1 else ''} {what}: {kind}{'s' if len(shown) > 1 else ''} " \
           f"{', '.join(nums)}{more}"


def load_table(path: str, key: str, split_for: str = "train") -> Table:
    """Rows of one data file/directory; DataError naming `key` and the file when it is unusable."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{key}: no file or directory at {p.resolve()}")
    if not p.is_dir() and not p.is_file():  # a FIFO waits for a writer forever; /dev/zero never ends
        raise DataError(f"{key}: {p} is not a regular file (a pipe, device or socket: pre-flight reads data files "
                        "whole); point it at the data file itself")
    fmt, gz = file_format(p)
    if p.is_dir():
        table = _load_saved(p, key, split_for)
    elif fmt in JSONL:
        table = _load_jsonl(p, key)
    elif fmt == ".json":
        table = _load_json(p, key)
    elif fmt in (".csv", ".tsv"):
        table = _load_csv(p, key)
    elif fmt == ".parquet" and not gz:
        table = _load_columnar(p, key)
    else:
        raise DataError(f"{key}: {p} is not {', '.join(FORMATS)} (each also gzip'ed: .jsonl.gz ...) nor .parquet, "
                        "nor a saved `datasets` directory")
    if not table.rows:
        raise DataError(f"{key}: {p} holds no rows (an empty data set)")
    return table


def file_format(p: Path) -> tuple[str, bool]:
    """(the data format its name says, in lower case: '.jsonl'; whether it is gzip'ed: a last '.gz')."""
    suffixes = [x.lower() for x in p.suffixes]
    gz = suffixes[-1:] == [".gz"]
    rest = suffixes[:-1] if gz else suffixes
    return (rest[-1] if rest else ""), gz


def read_bytes(p: Path, key: str) -> bytes:
    """The file's bytes, un-gzipped when its name ends in .gz (DataError when it is not gzip data, or unreadable)."""
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise DataError(f"{key}: cannot read {p}: {type(exc).__name__}: {exc.strerror or exc}") from None
    if not file_format(p)[1]:
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{key}: {p} is named .gz but cannot be un-gzipped: {type(exc).__name__}: {exc}") from None


def _load_jsonl(p: Path, key: str) -> Table:
    rows, lines, bad_json, not_object, not_text = [], [], [], [], []
    for n, raw in enumerate(read_bytes(p, key).splitlines(keepends=True), 1):  # bytes: a line not in UTF-8 is named
        try:  # -sig: an editor's byte-order mark is dropped (as for CSV)
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            not_text.append(f"line {n} (byte {exc.start + 1}: {raw[exc.start:exc.start + 1]!r})")
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            bad_json.append(f"line {n} ({exc.msg}, column {exc.colno})")
            continue
        if not isinstance(row, dict):
            not_object.append(f"line {n} (a {type(row).__name__})")
            continue
        rows.append(row)
        lines.append(n)
    problems = [listed(what, labels) for what, labels in (("not in UTF-8 (a binary file?)", not_text),
                                                          ("with invalid JSON", bad_json),
                                                          ("with a JSON value that is not an object", not_object)) if labels]
    if problems:
        raise DataError(f"{key}: {p}:{lines_of(problems)}")
    return Table(p, rows, lambda i: f"{p}:{lines[i]}", sorted({k for r in rows for k in r}),
                 lambda i: f"line {lines[i]}")


def _load_json(p: Path, key: str) -> Table:
    """A JSON list of objects, or {"data": [...]} (HF's json loader with field="data"); JSON Lines under a .json
    name (what `datasets`' to_json and pandas' to_json(lines=True) write) are read as JSONL."""
    raw = read_bytes(p, key)
    try:
        data = json.loads(raw.decode("utf-8-sig"))  # -sig: a byte-order mark is dropped
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and raw.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{"):
            return _load_jsonl(p, key)  # one object per line
        raise DataError(f"{key}: {p}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{key}: {p} is not UTF-8 text (byte {exc.start + 1}: {exc.object[exc.start:exc.start + 1]!r}); "
                        "a binary file?") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{key}: {p} must hold a JSON list of objects, or {{\"data\": [objects]}} (or use JSONL: "
                        f"one object per line){json_shape(data)}")
    return Table(p, data, lambda i: f"{p}[row {i}]", sorted({k for r in data for k in r}), lambda i: f"row {i}")


def json_shape(data: Any) -> str:
    """What a .json file holds instead of rows: '; it holds an object of columns (pandas' to_json default: write
    to_json(path, orient="records"))' / '; it holds an object with the keys [...]' / '; it holds a list of str'."""
    if isinstance(data, dict):
        if data and all(isinstance(v, dict) for v in data.values()):
            return ("; it holds an object of columns {column: {row: value}} (pandas' to_json default): write "
                    "df.to_json(path, orient=\"records\", lines=True)")
        lists = [k for k, v in data.items() if isinstance(v, list)]
        return f"; it holds an object with the keys {sorted(data)[:10]}" + (
            f" (lists under {lists[:5]}: save the one you want as a list or JSONL)" if lists else "")
    if isinstance(data, list):
        kinds = sorted({type(r).__name__ for r in data if not isinstance(r, dict)})
        return f"; it holds a list with {', '.join(kinds)} items"
    return f"; it holds a {type(data).__name__}"


def _load_csv(p: Path, key: str) -> Table:
    """Every cell as the string the file holds (no type guessing: "0487" stays "0487"); .tsv: tab-separated."""
    rows, lines, short, delimiter = [], [], [], "\t" if file_format(p)[0] == ".tsv" else ","
    csv.field_size_limit(2**31 - 1)  # long-context prompts: the csv module's default cap is 128 KiB a cell
    try:  # -sig: a spreadsheet's byte-order mark is dropped
        with io.TextIOWrapper(io.BytesIO(read_bytes(p, key)), encoding="utf-8-sig", newline="") as fh:
            reader = csv.DictReader(fh, delimiter=delimiter)
            names = list(reader.fieldnames or [])
            check_header(p, key, names, delimiter)
            for row in reader:
                if None in row:  # more cells than the header names
                    raise DataError(f"{key}: {p}:{reader.line_num}: {len(row) - 1 + len(row[None])} cells, the "
                                    f"header names {len(reader.fieldnames or [])}")
                if None in row.values():  # fewer (the csv module fills them with None)
                    short.append(f"line {reader.line_num}")
                rows.append(row)
                lines.append(reader.line_num)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{key}: cannot read {p} as CSV: {type(exc).__name__}: {exc}") from None
    if short:
        raise DataError(f"{key}: {p}: {listed(f'with fewer cells than the header names ({len(names)})', short)}")
    return Table(p, rows, lambda i: f"{p}:{lines[i]}", names, lambda i: f"line {lines[i]}")


def check_header(p: Path, key: str, names: list[str], delimiter: str) -> None:
    """A header that names a column twice (the csv module keeps the last one's cells), or one column that holds
    another delimiter (a ';'-separated export, a .csv of tabs): DataError."""
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DataError(f"{key}: {p}: the header names {', '.join(map(repr, twice))} more than once "
                        "(only the last one's cells would be read): rename them")
    other = next((d for d in (";", "\t", "|") if d != delimiter and len(names) == 1 and d in names[0]), None)
    if other:
        raise DataError(f"{key}: {p}: the header is one column, {names[0][:80]!r}: the file is separated by "
                        f"{other!r}, not {delimiter!r}; write it with commas (.csv) or tabs (.tsv)")


def _load_columnar(p: Path, key: str) -> Table:
    import datasets  # here: heavy (pyarrow, pandas), and pre-flight imports this module

    try:
        import pyarrow.parquet as pq  # (the same)

        ds = datasets.Dataset(pq.read_table(p))
    except Exception as exc:  # noqa: BLE001 - a corrupt file: say which
        raise DataError(f"{key}: cannot read {p}: {type(exc).__name__}: {exc}") from None
    return _from_dataset(ds, p)


def _load_saved(p: Path, key: str, split_for: str) -> Table:
    import datasets  # here: heavy (pyarrow, pandas), and pre-flight imports this module

    if not any((p / m).exists() for m in SAVED_DATASET_MARKERS):
        raise DataError(f"{key}: {p} is a directory but not one written by datasets' save_to_disk{files_in(p)}")
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{key}: cannot load the saved dataset {p}: {type(exc).__name__}: {exc}") from None
    if isinstance(ds, datasets.DatasetDict):
        wanted = ("train",) if split_for == "train" else VAL_SPLITS
        split = next((s for s in wanted if s in ds), None)
        if split is None:
            raise DataError(f"{key}: {p} holds splits {list(ds)}, none of {list(wanted)}; "
                            f"save the split you want on its own, or name it {wanted[0]!r}")
        return _from_dataset(ds[split], p, f"{split} ")
    return _from_dataset(ds, p)


def files_in(p: Path, shown: int = 3) -> str:
    """'; it holds 2 data files: point the key at one: data/train-00000-of-00001.parquet, ...' (a hub snapshot)."""
    found = sorted(str(f.relative_to(p)) for f in islice(p.rglob("*"), 5000)  # (a home directory: bounded)
                   if f.is_file() and not f.name.startswith(".") and file_format(f)[0] in (*FORMATS, ".parquet"))
    if not found:
        return ""
    more = ", ..." if len(found) > shown else ""
    return (f"; it holds {len(found)} data file{'s' if len(found) != 1 else ''}: point the key at one (the path "
            f"under {p}): {', '.join(found[:shown])}{more}")


def _from_dataset(ds, p: Path, split: str = "") -> Table:
    return Table(p, ds.to_list(), lambda i: f"{p}[{split}row {i}]", list(ds.column_names),
                 lambda i: f"{split}row {i}")


def check_rows(table: Table, env: EnvSpec, key: str) -> None:
    """Every row holds the prompt (and answer) column with a value, and a prompt the model can be given: one
    DataError naming every row that does not, grouped by problem."""
    knobs = {env.prompt_key: "env.prompt_key", **({env.answer_key: "env.answer_key"} if env.answer_key else {})}
    bad: dict[str, list[int]] = {}
    for i, row in enumerate(table.rows):
        for k, knob in knobs.items():
            if k not in row:
                bad.setdefault(f"without {k!r} ({knob}", []).append(i)
            elif empty(row[k]):
                bad.setdefault(f"with an empty {k!r} ({knob})", []).append(i)
        prompt = row.get(env.prompt_key)
        problem = None if isinstance(prompt, str) or empty(prompt) else prompt_problem(prompt)
        if problem:
            bad.setdefault(f"whose {env.prompt_key!r} {problem}", []).append(i)
    if not bad:
        return
    everywhere = {what for what, rows in bad.items() if what.startswith("without") and len(rows) == len(table.rows)}
    lines = [f"no row has {what[len('without '):]})" if what in everywhere
             else listed(what + (")" if what.startswith("without") else ""), [table.label(i) for i in rows])
             for what, rows in bad.items()]
    missing = next((i for what, rows in bad.items() if what.startswith("without") and what not in everywhere
                    for i in rows[:1]), None)
    hint = "" if missing is None else f"{table.where(missing)} has the keys {sorted(table.rows[missing])}"
    hint = f"the columns: {', '.join(table.columns)}{nested(table, env.prompt_key)}" if everywhere else hint
    raise DataError(f"{key}: {table.path}:{lines_of(lines + ([hint] if hint else []))}")


def nested(table: Table, key: str) -> str:
    """' (the rows are objects under 'row': write each row's 'row' as the line)' when a column holds objects with the
    key (the HF datasets-server's {"row_idx", "row"} lines), else ''."""
    first = table.rows[0]
    under = next((c for c in table.columns if isinstance(first.get(c), dict) and key in first[c]), None)
    return f" (the rows are objects under {under!r}: write each row's {under!r} as the line)" if under else ""


INVISIBLE = str.maketrans("", "", "\u200b\u200c\u200d\u2060\ufeff")  # zero-width spaces, joiners, BOM


def empty(value: Any) -> bool:
    """No value: null, "" or only blanks (zero-width ones too), NaN (pandas' missing number), an empty message list
    or object."""
    return (value is None or (isinstance(value, str) and not value.translate(INVISIBLE).strip()) or value == []
            or value == {}
            or (isinstance(value, float) and math.isnan(value)))


ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")  # ipython: Llama 3.1's tool


def prompt_problem(prompt: Any) -> Optional[str]:
    """Why a prompt cannot be given to the model as it is meant ('is neither a string nor ...'), or None. A message
    list is what chat templates render: {"role", "content"} objects, the roles of ROLES, text content (none beside an
    assistant's tool_calls), and not ending with the assistant's message (the answer: the model would be shown it)."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, list):
        return "is neither a string nor a list of chat messages"
    if not all(isinstance(m, dict) for m in prompt):
        return "holds an item that is not a {\"role\", \"content\"} object"
    if any("role" not in m and {"from", "value"} <= set(m) for m in prompt):
        return "holds ShareGPT-style {\"from\", \"value\"} messages, not {\"role\", \"content\"}"
    roles = [m.get("role") for m in prompt if m.get("role") not in ROLES]
    if roles:
        return f"holds a message whose role is {roles[0]!r}, not one of {', '.join(ROLES)}"
    if not all(isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls")) for m in prompt):
        return "holds a message whose content is not text"
    if prompt[-1]["role"] == "assistant":
        return ("ends with the assistant's message (the model would be shown it: drop it from the prompt, or move it "
                "to the answer column)")
    return None


TEXT_PARTS = ("text", "input_text")  # Chat Completions' and the Responses API's text part types


def text_parts(prompt: Any) -> Any:
    """A message list with OpenAI-style content parts ([{"type": "text", "text": ...}]) as the text it holds (what a
    template that reads parts renders; a text-only template would print the list); any other value as it is."""
    if not isinstance(prompt, list):
        return prompt
    out = []
    for m in prompt:
        parts = m.get("content") if isinstance(m, dict) else None
        if isinstance(parts, list) and parts and all(isinstance(x, dict) and x.get("type") in TEXT_PARTS
                                                     and isinstance(x.get("text"), str) for x in parts):
            m = {**m, "content": "".join(x["text"] for x in parts)}
        out.append(m)
    return out


def as_messages(prompt: Any) -> Any:
    """A string holding the JSON text of a chat-message list (objects with a "role", or ShareGPT's "from") → that
    list, for check_rows to judge (content parts, a bad role: named, not given to the model as JSON text); any other
    value as it is."""
    if not isinstance(prompt, str) or not prompt.lstrip().startswith("[{"):
        return prompt
    try:
        msgs = json.loads(prompt)
    except ValueError:
        return prompt
    ok = isinstance(msgs, list) and msgs and all(isinstance(m, dict) and ("role" in m or "from" in m) for m in msgs)
    return msgs if ok else prompt


def answer_text(value: Any) -> str:
    """The answer as the built-in scorers compare it: a string as it is, any other JSON value as JSON text; a
    Parquet decimal (1.50) as its digits, binary as UTF-8 text, a date (or any other value JSON lacks) as str()."""
    if isinstance(value, str):
        return value
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return json.dumps(value, default=str)


def load_split(env: EnvSpec, which: str) -> Table:
    key = f"env.{which}_path"
    path = getattr(env, f"{which}_path")
    if not path:
        raise DataError(f"{key}: env={env.name} reads its prompts from files: set {key}")
    table = load_table(path, key, split_for=which)
    for row in table.rows:
        if env.prompt_key in row:
            row[env.prompt_key] = text_parts(as_messages(row[env.prompt_key]))
    check_rows(table, env, key)
    if env.answer_key not in (None, "answer"):  # the built-in rewards (and env=math's grader) read `answer`: the
        for row in table.rows:  # column env.answer_key names (MATH's `solution`, OlympiadBench's `final_answer`);
            row["answer"] = row[env.answer_key]  # env=dataset's exact_match compared with None ('None') without it
    return table


class DatasetEnv:
    DEFAULT_REWARD: Optional[str] = "grpo_launcher.envs.rewards:exact_match"  # when no env.reward_fn(s)
    data_origin: tuple[int, int] = (0, 0)  # set by the trainer on a resume (envs/base.py first_position)

    def __init__(self, spec: EnvSpec, seed: int = 0):
        self.spec, self.seed = spec, seed
        self.rewards = R.load_rewards(spec, self.DEFAULT_REWARD)
        if not self.rewards:
            raise UserCodeError(f"env.reward_fn: env={spec.name} scores completions with your function: set "
                                "env.reward_fn=path/to/rewards.py:function (or a built-in on the answer column: "
                                "grpo_launcher.envs.rewards:exact_match, or grpo_launcher.envs.math:"
                                "math_verify_match for math answers)")
        self._tables: dict[str, Table] = {}

    # ------------------------------------------------------------------ data (loaded on first use)
    def table(self, which: str) -> Table:
        if which not in self._tables:
            self._tables[which] = load_split(self.spec, which)
        return self._tables[which]

    def _prompt(self, table: Table, i: int) -> Prompt:
        row, e = table.rows[i], self.spec
        answer = "" if not e.answer_key else answer_text(row[e.answer_key])
        return Prompt(text=row[e.prompt_key], answer=answer, agent_ref=f"{e.name}/{table.path.stem}", row=row,
                      source=table.where(i))

    @lru_cache(maxsize=4)  # noqa: B019 - one env per process
    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.table("train").rows)))
        if self.spec.shuffle:
            random.Random(f"epoch-{self.seed}-{epoch}").shuffle(order)
        return order

    def train_prompts(self, step: int, round_: int, n: int) -> list[Prompt]:
        t = self.table("train")
        N = len(t.rows)
        if round_ > 0:  # dynamic-sampling refill
            rng = random.Random(f"refill-{self.seed}-{step}-{round_}")
            return [self._prompt(t, rng.randrange(N)) for _ in range(n)]
        first = first_position(self.data_origin, step, n)  # steps count from 1
        return [self._prompt(t, self._order(k // N)[k % N]) for k in range(first, first + n)]

    def val_prompts(self) -> list[Prompt]:
        t = self.table("val")
        return [self._prompt(t, i) for i in range(len(t.rows))]

    def score(self, prompt: Prompt, completion: str) -> float:
        return self.score_detail(prompt, completion).total

    def score_detail(self, prompt: Prompt, completion: str) -> R.Scored:
        """The reward with each function's value (the per-function metrics, the train-data log)."""
        return R.score(self.rewards, prompt.text, completion, prompt.row, self.spec.prompt_key,
                       prompt.source or "?", on_error=self.spec.reward_errors.value)

    def warmup_examples(self, n: int) -> list[tuple[str, str]]:
        t = self.table("train")
        if not self.spec.answer_key or not all(isinstance(r[self.spec.prompt_key], str) for r in t.rows):
            return []
        rng = random.Random(f"warmup-{self.seed}")
        return [(p.text, p.answer) for p in (self._prompt(t, rng.randrange(len(t.rows))) for _ in range(n))]

    def __getstate__(self) -> dict[str, Any]:  # to a worker: the scorer, not the data
        return {**self.__dict__, "_tables": {}}
