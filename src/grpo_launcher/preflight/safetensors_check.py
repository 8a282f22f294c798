"""model.path's weights are readable: every *.safetensors header checked against its file, at pre-flight.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}), then the tensors' bytes, offsets counted from the end of the
header. Only the header is read (a few KiB to MiBs, no safetensors or torch import): a truncated copy, a header
that claims more bytes than the file has (4 EiB), or offsets past the end is a config error naming the file,
instead of a Ray traceback from the workers' load a minute later.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterator, Optional

from ..spec.errors import Violation
from ..spec.schema import RunSpec

PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # PyTorch's pickle formats (pytorch_model.bin, ...)
MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers (MAX_HEADER_SIZE)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
RULE = "model_weights_readable"
FIX = "copy the file again (compare its size with the source's) or re-export the model with save_pretrained"


def header_problem(file: Path) -> Optional[str]:
    """Why the loader would refuse `file` (its header against its size), or None."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"is {size} bytes: too short for a safetensors header (truncated)"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return (f"has a header that claims {n:,} bytes but the file is {size:,} bytes "
                        f"({'truncated' if n < MAX_HEADER else 'corrupt header length'})")
            if n > MAX_HEADER:
                return f"has a {n:,}-byte header (the loader refuses more than {MAX_HEADER:,})"
            raw = f.read(n)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        return f"has a header that is not valid JSON ({str(exc)[:80]})"
    if not isinstance(header, dict):
        return "has a header that is not a JSON object"
    return offsets_problem(header, size - 8 - n)


def offsets_problem(header: dict, data_bytes: int) -> Optional[str]:
    """Each tensor's [begin, end) within the data and of its shape's size; together they cover the data exactly."""
    end_max = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            need = math.prod(int(d) for d in info["shape"]) * DTYPE_BYTES.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            return f"has a malformed entry for tensor {name[:80]!r} (dtype, shape, data_offsets)"
        if not 0 <= begin <= end:
            return f"tensor {name[:80]!r} has data_offsets [{begin}, {end}]"
        if end > data_bytes:
            return (f"tensor {name[:80]!r} ends at byte {end:,} of the data but the file holds {data_bytes:,} "
                    "bytes of data (truncated)")
        if need and end - begin != need:
            return f"tensor {name[:80]!r} takes {end - begin:,} bytes, its dtype and shape {need:,}"
        end_max = max(end_max, end)
    if end_max != data_bytes:
        return f"has {data_bytes - end_max:,} bytes after its last tensor (the loader refuses it)"
    return None


def weight_files(path: Path) -> list[Path]:
    """The *.safetensors files of a model directory (a sharded model's shards included)."""
    return sorted(p for p in path.glob("*.safetensors") if p.is_file())


def missing_shards(path: Path) -> list[str]:
    """Shards model.safetensors.index.json names that are not in the directory."""
    index = path / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return []
    return sorted({str(f) for f in weight_map.values() if isinstance(f, str) and not (path / f).is_file()})


def weights_problems(spec: RunSpec) -> Iterator[Violation]:
    """Every unreadable weights file under model.path, each named (a path not here: local_paths_exist's)."""
    if not spec.model.path or not Path(spec.model.path).is_dir():
        return
    path = Path(spec.model.path)
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLED and p.is_file())
    if pickles and not weight_files(path):  # torch.load's weights_only refused it after start-up (UnpicklingError)
        yield Violation(RULE, ("model.path",), f"{path} holds no *.safetensors weights, only {', '.join(pickles[:3])}: "
                        "pickled weights are never loaded (a pickle runs code)",
                        "convert them on a machine that trusts the file: AutoModelForCausalLM.from_pretrained(DIR)"
                        ".save_pretrained(DIR) writes model.safetensors")
    for file in weight_files(path):
        why = header_problem(file)
        if why:
            yield Violation(RULE, ("model.path",), f"{file} {why}", FIX)
    for name in missing_shards(path):
        yield Violation(RULE, ("model.path",), f"{path / 'model.safetensors.index.json'} names {name}, which is "
                        f"not in {path}", FIX)
