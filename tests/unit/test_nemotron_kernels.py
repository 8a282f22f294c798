"""nemotron_h's Mamba-2 kernels (issue 40): which path the torch backend runs (models/nemotron_h.py, mirroring how
transformers' modeling_nemotron_h binds each function once, at import), the guard that keeps the torch references
where a kernel must not run (CPU; the fused train path without causal-conv1d), the plan's line, and the GPU kit's
patch of mamba-ssm's import of its CUDA extension (scripts/gpu_kit.py). CPU only: no mamba-ssm is installed here;
the kit's built wheel is checked by hand (scripts/gpu-kit.sh check on the node)."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
import types
from dataclasses import replace

import pytest

from grpo_launcher.models import nemotron_h as nh
from grpo_launcher.spec.compose import load_spec
from helpers import ROOT


def _kit():
    spec = importlib.util.spec_from_file_location("gpu_kit", ROOT / "scripts" / "gpu_kit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# mamba-ssm 2.3.2.post1's ops/selective_scan_interface.py, its first 21 lines (the file the kit patches)
INTERFACE_HEAD = """# Copyright (c) 2023, Tri Dao, Albert Gu.

import torch
import torch.nn.functional as F
from mamba_ssm.utils.torch import custom_bwd, custom_fwd

from einops import rearrange, repeat

try:
    from causal_conv1d import causal_conv1d_fn
    from causal_conv1d.cpp_functions import causal_conv1d_fwd_function, causal_conv1d_bwd_function, causal_conv1d_update_function
except ImportError:
    causal_conv1d_fn = None
    causal_conv1d_fwd_function = None
    causal_conv1d_bwd_function = None
    causal_conv1d_update_function = None

from mamba_ssm.ops.triton.layer_norm import _layer_norm_fwd

import selective_scan_cuda

"""


class TestKitPatch:
    def test_the_extension_import_becomes_optional_and_nothing_else_changes(self):
        kit = _kit()
        patched = kit.optional_extension_import(INTERFACE_HEAD)
        compile(patched, "selective_scan_interface.py", "exec")
        assert patched.replace(kit.OPTIONAL_IMPORT, kit.IMPORT_LINE) == INTERFACE_HEAD
        assert kit.optional_extension_import(patched) == patched  # idempotent
        namespace: dict = {}
        exec(kit.OPTIONAL_IMPORT, namespace)  # no selective_scan_cuda here: bound to None, no ImportError
        assert namespace["selective_scan_cuda"] is None

    def test_a_real_extension_is_still_imported(self, monkeypatch):
        ext = types.ModuleType("selective_scan_cuda")
        monkeypatch.setitem(sys.modules, "selective_scan_cuda", ext)
        namespace: dict = {}
        exec(_kit().OPTIONAL_IMPORT, namespace)
        assert namespace["selective_scan_cuda"] is ext

    @pytest.mark.parametrize("text", [INTERFACE_HEAD.replace("import selective_scan_cuda\n", ""),
                                      INTERFACE_HEAD + "import selective_scan_cuda\n",
                                      INTERFACE_HEAD.replace("import selective_scan_cuda\n",
                                                             "import selective_scan_cuda as ext\n")])
    def test_another_shape_of_the_file_is_refused_not_guessed(self, text):
        with pytest.raises(ValueError, match="differs from 2.3.x"):
            _kit().optional_extension_import(text)

    def test_causal_conv1d_builds_for_the_nodes_arch_alone(self):
        """causal-conv1d 1.6.0's setup.py lists eleven -gencode pairs; the node's build keeps the one for its GPU."""
        kit = _kit()
        setup = ("cc_flag = []\nif True:\n    cc_flag.append('-gencode')\n    cc_flag.append('arch=compute_75,code=sm_75')\n"
                 + kit.CONV_ANCHOR + "\n    pass\n")
        patched = kit.one_arch(setup, "90")
        namespace: dict = {}
        exec(patched.replace(kit.CONV_ANCHOR, "    # anchor"), namespace)
        assert namespace["cc_flag"] == ["-gencode", "arch=compute_90,code=sm_90"]
        assert kit.one_arch(patched, "90") == patched  # idempotent
        with pytest.raises(ValueError, match="read it first"):
            kit.one_arch(setup.replace(kit.CONV_ANCHOR, ""), "90")
        with pytest.raises(ValueError, match="digits"):
            kit.one_arch(setup, "90; rm -rf /")

    def test_the_plan_recognises_the_kits_build_from_its_files(self, tmp_path, monkeypatch):
        """mamba_packages (pre-flight: files only) counts mamba-ssm without selective_scan_cuda as importable only
        when its interface file carries the kit's patch."""
        ops = tmp_path / "mamba_ssm" / "ops"
        ops.mkdir(parents=True)
        (tmp_path / "mamba_ssm" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
        for name in [m for m in sys.modules if m.split(".")[0] == "mamba_ssm"]:  # a venv's own, imported earlier
            monkeypatch.delitem(sys.modules, name)
        (ops / "selective_scan_interface.py").write_text(INTERFACE_HEAD)
        assert nh.mamba_packages() == (False, False)  # the upstream file: `import mamba_ssm` would fail here
        (ops / "selective_scan_interface.py").write_text(_kit().optional_extension_import(INTERFACE_HEAD))
        assert nh.mamba_packages() == (True, False)
        assert "mamba_ssm" not in sys.modules  # judged from files, never imported


class TestMambaPath:
    def test_kernels_on_cuda_only_and_the_fused_path_only_with_both_packages(self):
        every = set(nh.MAMBA_FUNCTIONS)
        on = {args: {f for f, k in nh.mamba_kernels(*args).items() if k}
              for args in [(a, b, c) for a in (True, False) for b in (True, False) for c in (True, False)]}
        assert all(on[(a, b, False)] == set() for a in (True, False) for b in (True, False))  # CPU: pure torch
        assert on[(True, True, True)] == every
        assert on[(True, False, True)] == {"mamba2_chunk_scan", "mamba2_selective_state_update"}  # fused: absent
        assert on[(False, True, True)] == {"causal_conv1d_fn", "causal_conv1d_update"}
        assert on[(False, False, True)] == set()

    @pytest.mark.parametrize("args,words", [
        ((True, True, True), "mamba-ssm Triton kernels (chunk scan, state update), causal-conv1d's conv1d; "
                             "training: the fused split-conv1d-scan"),
        ((True, False, True), "mamba-ssm Triton kernels (chunk scan, state update), torch conv1d (causal-conv1d "
                              "absent); training: unfused (needs causal-conv1d)"),
        ((False, False, True), "pure torch scan (mamba-ssm does not import"),
        ((True, True, False), "pure torch (CPU"),
    ])
    def test_the_path_in_words(self, args, words):
        assert nh.mamba_path(*args).startswith(words)

    def test_the_table_is_transformers_own(self):
        """Each function name, package and kernel path as modeling_nemotron_h's decorators and transformers'
        internal path map give them; each is called from the mixer's forward as a module global (so rebinding it
        takes effect); the fused function's torch reference returns None (the forward then runs unfused)."""
        from transformers.integrations.hub_kernels import _KERNELS_INTERNAL_PATH_MAPPINGS as paths
        from transformers.models.nemotron_h import modeling_nemotron_h as modeling

        found = re.findall(r'@use_kernel_func_from_hub_with_fallback\("(\w+)", "(\w+)"\)\ndef (\w+)\(',
                           inspect.getsource(modeling))
        assert {name: (package, f"{paths[kernel]}.{kernel}" if kernel in paths else kernel)
                for kernel, package, name in found} == nh.MAMBA_FUNCTIONS
        forward = inspect.unwrap(modeling.NemotronHMamba2Mixer.forward)
        assert set(nh.MAMBA_FUNCTIONS) <= set(forward.__code__.co_names)
        fused = inspect.unwrap(getattr(modeling, nh.FUSED))
        assert fused.__module__ == modeling.__name__ and fused(*[None] * 6, chunk_size=1) is None

    def test_the_guard_on_cpu_keeps_transformers_torch_references(self):
        import torch
        from transformers import NemotronHConfig, NemotronHForCausalLM
        from transformers.models.nemotron_h import modeling_nemotron_h as modeling

        from nemotron_tiny import CONFIG

        before = {name: getattr(modeling, name) for name in nh.MAMBA_FUNCTIONS}
        model = NemotronHForCausalLM(NemotronHConfig(**CONFIG)).train()
        assert nh.bind_mamba_kernels(model, on_cuda=False) == nh.mamba_path(False, False, False)
        after = {name: getattr(modeling, name) for name in nh.MAMBA_FUNCTIONS}
        # without mamba-ssm nothing to rebind; with it (CPU venv), its kernels unbound again: the torch references
        assert all(after[n] is before[n] or after[n] is inspect.unwrap(before[n]) for n in before), after
        ids = torch.randint(3, 500, (2, 20))
        model(input_ids=ids, labels=ids).loss.backward()  # the train-mode forward runs (fused: None, then torch)
        assert nh.bind_mamba_kernels(types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen2")),
                                     on_cuda=True) == ""

    @pytest.mark.parametrize("mamba_heads", [4, 8])
    def test_in_proj_width_is_transformers_own(self, mamba_heads):
        """causal-conv1d is used only where 8 divides this width (its channel-last kernels' stride rule)."""
        from transformers import NemotronHConfig, NemotronHForCausalLM

        from nemotron_tiny import CONFIG

        cfg = NemotronHConfig(**{**CONFIG, "mamba_num_heads": mamba_heads})
        mixer = NemotronHForCausalLM(cfg).model.layers[0].mixer
        assert mixer.in_proj.out_features == nh.in_proj_width(cfg) == {4: 196, 8: 328}[mamba_heads]


class TestSeqIdxConv:
    """The torch conv1d that runs beside mamba-ssm's Triton scan when causal-conv1d is absent takes packed rows'
    seq_idx as causal-conv1d's kernel does (policy/packing.py passes it): CPU-checkable, unlike the scan."""

    @staticmethod
    def _reference():
        from transformers.models.nemotron_h import modeling_nemotron_h as modeling

        return modeling.causal_conv1d_fn

    @pytest.mark.parametrize("autocast", [False, True])
    def test_each_sequence_of_a_packed_row_is_convolved_on_its_own(self, autocast):
        import torch

        ref = self._reference()
        conv = nh.seq_idx_conv1d(ref)
        g = torch.Generator().manual_seed(0)
        lengths = [[5, 1, 7, 3], [16]]  # row 0: four sequences (one of a single token), row 1: one
        x, w, b = torch.randn(2, 6, 16, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
        seq_idx = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths], dtype=torch.int32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = conv(x, w, b, activation="silu", seq_idx=seq_idx)
            want = torch.zeros_like(got)
            for r, row in enumerate(lengths):
                start = 0
                for n in row:  # the conv of the sequence alone
                    want[r, :, start:start + n] = ref(x[r:r + 1, :, start:start + n], w, b, activation="silu")[0]
                    start += n
            assert torch.equal(conv(x, w, b, activation="silu"), ref(x, w, b, activation="silu"))  # no seq_idx: same
        tol = 2e-2 if autocast else 1e-6  # bf16: F.conv1d's and the taps' own rounding
        assert torch.allclose(got, want, atol=tol, rtol=tol)
        assert not torch.allclose(ref(x, w, b, activation="silu")[0, :, 5:8], want[0, :, 5:8], atol=1e-3)

    def test_bound_beside_the_triton_scan_only_and_restored(self, monkeypatch):
        """bind_mamba_kernels puts it in place where mamba-ssm's scan runs without causal-conv1d (as on the node),
        and gives the original back for the CPU. (mamba-ssm is absent here: its import check is stood in for.)"""
        from transformers.models.nemotron_h import modeling_nemotron_h as modeling

        from nemotron_tiny import CONFIG
        from transformers import NemotronHConfig, NemotronHForCausalLM

        original = modeling.causal_conv1d_fn
        for name in nh.MAMBA_FUNCTIONS:  # the rebinding is process-wide: restored after the test
            monkeypatch.setattr(modeling, name, getattr(modeling, name))
        monkeypatch.setattr(nh, "_imports", lambda package, path: package == "mamba_ssm")
        model = NemotronHForCausalLM(NemotronHConfig(**CONFIG))
        assert nh.bind_mamba_kernels(model, on_cuda=True).startswith("mamba-ssm Triton kernels")
        assert modeling.causal_conv1d_fn.seq_idx_aware and modeling.causal_conv1d_fn.__wrapped__ is original
        assert nh.varlen_mamba()
        nh.bind_mamba_kernels(model, on_cuda=True)  # again: not wrapped twice
        assert modeling.causal_conv1d_fn.__wrapped__ is original
        monkeypatch.setattr(nh, "_imports", lambda package, path: False)
        nh.bind_mamba_kernels(model, on_cuda=False)
        assert modeling.causal_conv1d_fn is original and not nh.varlen_mamba()


class TestPlanLine:
    def test_nemotron_h_on_the_torch_backend_only(self):
        spec = load_spec(["model=nemotron_h_tiny"])
        assert nh.plan_line(spec) == f"Mamba-2 path         : {nh.mamba_path(False, False, False)}"
        gpu = replace(spec, cluster=replace(spec.cluster, gpus_per_node=1))
        assert nh.plan_line(gpu).endswith("(judged from this interpreter's packages)")
        node_py = replace(gpu.cluster, python="/x/py", kind="slurm")  # a Slurm job's nodes' interpreter decides
        assert "node's packages decide" in nh.plan_line(replace(gpu, cluster=node_py))
        assert "node's packages decide" not in nh.plan_line(replace(gpu, cluster=replace(node_py, kind="local")))
        assert nh.plan_line(replace(spec, train=replace(spec.train, backend="megatron"))) == ""
        assert nh.plan_line(load_spec([])) == ""

    def test_the_dry_run_prints_it(self, launch_here, tmp_path):
        r = launch_here(tmp_path, "model=nemotron_h_tiny", "dry_run=true", f"output_root={tmp_path}")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "Mamba-2 path         : pure torch (CPU" in r.stdout
