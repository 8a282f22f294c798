"""Secrets in a run: which spec values are credentials, how they are redacted, where the job reads them.

A value is secret when its key's last part looks like one (token, secret, password, api_key, key) or when it
is a URI carrying a password (`scheme://user:PASSWORD@host`, `?password=`/`?token=` query values). Such values
are shown as `***` in the plan, `spec.yaml`, MLflow params and logs; the job gets the real values from
`RUN_DIR/.secrets.json` (0600, written next to the redacted spec.yaml) or from the environment. The spec kept in a
checkpoint's meta.json and the command lines under RUN_DIR/repro/ are redacted the same way (redacted_tree,
redact_argv). Shared by the Plan, launch/, the driver, the checkpoints and the tracker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from secrets import token_hex  # the standard library's; hex: no "-" to be read as an option anywhere
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .spec.schema import RunSpec

REDACTED = "***"
SECRET_KEY = re.compile(r"token$|secret|password|passwd|api_key|access_key|private_key|^key$", re.IGNORECASE)
URI_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*:)(?P<pw>[^@/\s]+)(?P<at>@)")
QUERY_SECRET = re.compile(r"(?P<head>[?&](?:password|passwd|token|secret|api_key|key|access_token)=)(?P<pw>[^&\s]+)",
                          re.IGNORECASE)
SECRETS_FILE = ".secrets.json"


def is_secret_key(dotted: str) -> bool:
    return bool(SECRET_KEY.search(dotted.rsplit(".", 1)[-1]))


def redact_value(value: Any) -> Any:
    """A string with URI passwords / secret query values replaced by ***; anything else unchanged."""
    if not isinstance(value, str):
        return value
    value = URI_PASSWORD.sub(lambda m: m["head"] + REDACTED + m["at"], value)
    return QUERY_SECRET.sub(lambda m: m["head"] + REDACTED, value)


def has_secret(dotted: str, value: Any) -> bool:
    if value is None or value == "" or value == []:
        return False
    return is_secret_key(dotted) or (isinstance(value, str) and redact_value(value) != value)


def redact_text(text: str) -> str:
    """YAML/log text: `key: value` lines with a secret-looking key, and URI passwords, redacted."""
    out = []
    for line in text.splitlines(keepends=True):
        m = re.match(r"^(\s*)([A-Za-z0-9_]+)(:\s+)(\S.*?)(\s*)$", line.rstrip("\n"))
        if m and is_secret_key(m.group(2)) and m.group(4) not in ("null", "''", '""', "[]"):
            line = f"{m.group(1)}{m.group(2)}{m.group(3)}'{REDACTED}'" + ("\n" if line.endswith("\n") else "")
        out.append(redact_value(line))
    return "".join(out)


def redacted_tree(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A copy of a nested dict with every secret leaf *** and passwords inside URIs redacted."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out[key] = redacted_tree(value, dotted + ".")
        elif is_secret_key(dotted) and has_secret(dotted, value):
            out[key] = REDACTED
        else:
            out[key] = [redact_value(v) for v in value] if isinstance(value, list) else redact_value(value)
    return out


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the values of secret overrides (`rollout.http_api_key=...`, `+x.token=...`) as *** and
    passwords inside URIs redacted."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        secret = eq and is_secret_key(key.lstrip("+~")) and value not in ("", "null")
        out.append(f"{key}={REDACTED}" if secret else redact_value(arg))
    return out


def has_secret_argument(argv: list[str]) -> bool:
    return redact_argv(argv) != list(argv)


def secret_values(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted.key: value} of every secret leaf of a nested dict."""
    found: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            found.update(secret_values(value, dotted + "."))
        elif has_secret(dotted, value):
            found[dotted] = value
    return found


def write_private(path: Path, text: str) -> None:
    """Write a file only the owner can read (0600 from creation: never briefly world-readable)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def save_secrets(run_dir: Path, secrets: dict[str, Any]) -> None:
    path = Path(run_dir) / SECRETS_FILE
    if secrets:
        write_private(path, json.dumps(secrets, indent=1) + "\n")
    else:
        path.unlink(missing_ok=True)


def load_secrets(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / SECRETS_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def with_http_api_key(spec: RunSpec) -> RunSpec:
    """rollout.expose_http_server with http_api_key null: the spec with a fresh random key for this run."""
    r = spec.rollout
    if not r.expose_http_server or r.http_api_key is not None:
        return spec
    return dataclasses.replace(spec, rollout=dataclasses.replace(r, http_api_key=token_hex(32)))
