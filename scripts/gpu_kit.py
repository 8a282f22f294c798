"""The GPU kit's Python half (scripts/gpu-kit.sh calls it):

  python3 scripts/gpu_kit.py patch-mamba UNPACKED_WHEEL_DIR   (at build time, here)
  python3 scripts/gpu_kit.py check                            (on the node, PYTHONPATH=SITE:src; gpu-kit.sh check)
  python3 scripts/gpu_kit.py one-arch SETUP_PY ARCH             (on the node: causal-conv1d for its GPU only)

patch-mamba: mamba-ssm built with MAMBA_SKIP_CUDA_BUILD=TRUE has no `selective_scan_cuda` extension, yet
`mamba_ssm/__init__.py` imports it (through ops/selective_scan_interface.py) unconditionally, so `import mamba_ssm`
fails and transformers' NemotronH silently falls back to its pure-torch Mamba-2. The patch makes that one import
optional (the module name is bound to None when absent, mamba-ssm's own convention for causal-conv1d): the Triton
kernels (mamba_chunk_scan_combined, selective_state_update, the gated RMSNorm) import and run; only Mamba-1's
selective_scan_fn / mamba_inner_fn need the extension, and they fail when called. Nothing else is changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

PATCHED_FILE = "mamba_ssm/ops/selective_scan_interface.py"
IMPORT_LINE = "import selective_scan_cuda\n"
MARK = "grpo-launcher gpu-kit"  # in the patched text: the kit's build, not mamba-ssm's (grpo_launcher reads it too)
OPTIONAL_IMPORT = (
    f"try:  # {MARK}: built with MAMBA_SKIP_CUDA_BUILD=TRUE, no CUDA extension; the Triton kernels need none\n"
    "    import selective_scan_cuda\n"
    "except ImportError:\n"
    "    selective_scan_cuda = None  # selective_scan_fn / mamba_inner_fn (Mamba-1) need it: they fail when called\n"
)


def optional_extension_import(source: str) -> str:
    """selective_scan_interface.py's text with its `import selective_scan_cuda` made optional. Idempotent; any
    other shape of the file (a mamba-ssm that moved or reworded the import) is refused, not guessed at."""
    if MARK in source:
        return source
    lines = source.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line == IMPORT_LINE]
    if len(hits) != 1:
        raise ValueError(f"expected one top-level line {IMPORT_LINE.strip()!r} in {PATCHED_FILE}, found {len(hits)}: "
                         "this mamba-ssm differs from 2.3.x; read its import of the extension before patching")
    lines[hits[0]] = OPTIONAL_IMPORT
    return "".join(lines)


def patch_mamba(wheel_dir: Path) -> None:
    path = wheel_dir / PATCHED_FILE
    path.write_text(optional_extension_import(path.read_text()))
    print(f"patched {path.relative_to(wheel_dir)}: `import selective_scan_cuda` optional")


CONV_ANCHOR = "    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI"


def one_arch(source: str, arch: str) -> str:
    """causal-conv1d's setup.py text compiling for one GPU architecture (e.g. "90"), not its list of eleven: the
    node builds for the card it has, in a fraction of the time. Refused when the anchor line is not there once."""
    if not arch.isdigit():
        raise ValueError(f"arch {arch!r}: digits expected, e.g. 90")
    if MARK in source:
        return source
    if source.count(CONV_ANCHOR) != 1:
        raise ValueError(f"expected one line {CONV_ANCHOR.strip()!r} in causal-conv1d's setup.py: read it first")
    line = f'    cc_flag = ["-gencode", "arch=compute_{arch},code=sm_{arch}"]  # {MARK}: this node\'s GPU only\n'
    return source.replace(CONV_ANCHOR, line + CONV_ANCHOR)


def _try(fn) -> tuple[bool, str]:
    try:
        return True, fn()
    except Exception as exc:  # a report: every part is tried, whatever the others do
        return False, f"{type(exc).__name__}: {exc}"[:300]


def _version(dist: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(dist)


def _vllm() -> str:
    import importlib

    import torch

    from grpo_launcher.spec.versions import MOE_LIBRARY, cuda_vllm_dir, installed, vllm_moe_gap

    vllm_dir = cuda_vllm_dir()
    if vllm_dir is None:
        raise ModuleNotFoundError("no CUDA vLLM (distribution `vllm`) installed")
    gap = vllm_moe_gap(vllm_dir)  # what pre-flight's gate reads (files)
    if gap is not None:
        raise FileNotFoundError(gap)
    (lib,) = sorted(vllm_dir.glob(MOE_LIBRARY))[:1]
    importlib.import_module(f"vllm.{lib.name.split('.')[0]}")  # then what vLLM's CUDA platform loads
    if not hasattr(torch.ops._moe_C, "grouped_topk"):
        raise AttributeError(f"{lib.name} loaded, but torch.ops._moe_C has no grouped_topk")
    return f"vllm {installed('vllm')}, {lib.name} ({lib.stat().st_size / 2**20:.0f} MiB): _moe_C.grouped_topk"


def _mamba() -> str:
    from mamba_ssm.ops.selective_scan_interface import selective_scan_cuda  # the patched import: None without it
    from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn  # noqa: F401
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update  # noqa: F401
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined  # noqa: F401

    ext = "its CUDA extension" if selective_scan_cuda is not None else "no CUDA extension (kit build)"
    return f"mamba-ssm {_version('mamba_ssm')}: Triton kernels import; {ext}"


def _causal_conv1d() -> str:
    from causal_conv1d import causal_conv1d_fn  # noqa: F401

    return f"causal-conv1d {_version('causal_conv1d')}"


def _flash_attn() -> str:
    import flash_attn

    return f"flash-attn {flash_attn.__version__}"


def _te() -> str:
    import transformer_engine.pytorch  # noqa: F401

    return f"transformer-engine {_version('transformer_engine')}"


def _submitit() -> str:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher  # noqa: F401

    return f"hydra-submitit-launcher {_version('hydra-submitit-launcher')}, submitit {_version('submitit')}"


def _nemotron_h_path() -> str:
    import torch

    from grpo_launcher.models.nemotron_h import mamba_path, mamba_packages

    return mamba_path(*mamba_packages(), on_cuda=torch.cuda.is_available())


PARTS = {"vllm + MoE library": _vllm, "mamba-ssm (Triton)": _mamba, "causal-conv1d": _causal_conv1d,
         "flash-attn": _flash_attn, "Transformer Engine": _te, "submitit plugin": _submitit,
         "nemotron_h Mamba-2 path": _nemotron_h_path}


def check() -> int:
    """What of the kit's parts (and the node's own) imports here. A report: exits 0 whatever is absent."""
    width = max(map(len, PARTS))
    for name, probe in PARTS.items():
        ok, what = _try(probe)
        print(f"{name:<{width}} : {'yes' if ok else 'NO '}  {what}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["patch-mamba"] and len(sys.argv) == 3:
        patch_mamba(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["one-arch"] and len(sys.argv) == 4:
        setup = Path(sys.argv[2])
        setup.write_text(one_arch(setup.read_text(), sys.argv[3]))
    elif sys.argv[1:] == ["check"]:
        sys.exit(check())
    else:
        sys.exit(__doc__)
