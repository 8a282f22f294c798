"""Machine-readable run status: `<run_dir>/status.json`, written atomically (temp file + rename).

Used by the sbatch script (`python -m grpo_launcher.launch.status RUN_DIR STATE --job-id N`) and by
`launch.py status|logs|cancel`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

STATES = ("SUBMITTED", "RUNNING", "REQUEUED", "COMPLETED", "FAILED", "CANCELLED")


def write_status(run_dir: Path, state: str, **fields: object) -> dict:
    run_dir = Path(run_dir)
    current = read_status(run_dir)
    current.update({k: v for k, v in fields.items() if v is not None})
    current.update(state=state, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
    tmp = run_dir / f".status.json.{os.getpid()}"
    tmp.write_text(json.dumps(current, indent=1) + "\n")
    os.replace(tmp, run_dir / "status.json")
    return current


def read_status(run_dir: Path) -> dict:
    path = Path(run_dir) / "status.json"
    return json.loads(path.read_text()) if path.exists() else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("state", choices=STATES)
    ap.add_argument("--job-id")
    ap.add_argument("--exit-code", type=int)
    a = ap.parse_args()
    write_status(a.run_dir, a.state, job_id=a.job_id, exit_code=a.exit_code)


if __name__ == "__main__":
    main()
