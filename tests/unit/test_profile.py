"""logging.profile_step: kernel names sorted into classes, summed per class (hand-checked names)."""

import pytest
import torch

from grpo_launcher.policy.profile import PhaseProfiler, by_class, kernel_class, summary_line


@pytest.mark.parametrize("name,cls", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("aten::mm", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),  # attention wins over its cutlass name
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "softmax/loss"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda>", "copy/cast"),
    ("Memcpy DtoH (Device -> Pinned)", "copy/cast"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps>>", "reduction"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("some_new_kernel", "other"),
])
def test_kernel_class(name, cls):
    assert kernel_class(name) == cls


def test_by_class_sums_microseconds_into_ms_largest_first():
    out = by_class([("aten::mm", 3000.0), ("flash_fwd", 500.0), ("aten::addmm", 1000.0), ("x", 250.0)])
    assert out == {"gemm": 4.0, "attention": 0.5, "other": 0.25}
    assert list(out) == ["gemm", "attention", "other"]


def test_a_phase_is_profiled_only_while_armed_and_nested_phases_fold_in(tmp_path):
    prof, lin = PhaseProfiler(), torch.nn.Linear(32, 32)
    with prof.phase("update", torch.device("cpu")):
        lin(torch.randn(4, 32))
    assert prof.phases == {}  # not armed: nothing recorded, nothing written
    prof.armed = tmp_path
    with prof.phase("update", torch.device("cpu")):
        with prof.phase("logprobs", torch.device("cpu")):  # inside update: part of it
            lin(torch.randn(4, 32)).sum().backward()
    assert list(prof.phases) == ["update"] and prof.phases["update"]["classes_ms"]["gemm"] > 0
    assert (tmp_path / f"{tmp_path.name}_update.trace.json").exists()
    assert summary_line(prof.phases).startswith("update ")
