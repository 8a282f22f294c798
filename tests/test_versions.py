"""The launch-time version gate (spec/versions.py): a package outside its tested range is refused at pre-flight,
named with its version and the range, before Ray starts; cluster.untested_versions=true launches anyway."""

from __future__ import annotations

from dataclasses import replace

import pytest

from grpo_launcher.spec import versions
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.errors import ConfigError


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
        assert list(versions.untested(replace(spec, cluster=replace(spec.cluster, **nodes_own)))) == []


@pytest.mark.parametrize("version,ok", [("0.25.0", True), ("0.32.0+cpu", True), ("0.33.0", False), ("0.24.9", False),
                                        ("0.33.0rc1", False), ("garbage", False)])
def test_range_edges(version, ok):
    spec = load_spec(["rollout=vllm"])
    found = list(versions.untested(spec, lambda p: version if p == "vllm" else versions.installed(p)))
    assert (found == []) == ok, found
