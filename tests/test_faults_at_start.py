"""Faults pre-flight can see are config errors before anything starts (issue 43, items 5, 6, 11): real faults, not
mocks: a truncated file, a port nothing listens on, a read-only directory, a full tmpfs.

Pre-flight and dry runs go through launch.py's main in this process (nothing started)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "vocab_size": 512, "tie_word_embeddings": True}
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


# ----------------------------------------------------------------------------- model.safetensors
def model_dir(path: Path) -> Path:
    """An HF model directory (config.json, tokenizer stubs) whose model.safetensors is real and complete."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(QWEN2))
    (path / "tokenizer.json").write_text("{}")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<e>", "pad_token": "<p>"}))
    save_file({"embed.weight": torch.zeros(512, 64), "norm.weight": torch.ones(64)}, str(path / "model.safetensors"))
    return path


def dry_run(launch_here, tmp_path: Path, d: Path, *more: str):
    return launch_here(tmp_path, f"model.path={d}", f"output_root={tmp_path}", "train.max_total_sequence_length=64",
                       "dry_run=true", *more)


def test_complete_safetensors_passes(tmp_path, launch_here):
    run = dry_run(launch_here, tmp_path, model_dir(tmp_path / "m"))
    assert run.returncode == 0, run.stderr


def test_truncated_safetensors_is_a_config_error_naming_the_file(tmp_path, launch_here):
    d = model_dir(tmp_path / "m")
    file = d / "model.safetensors"
    os.truncate(file, file.stat().st_size // 2)  # a copy that stopped half-way
    run = dry_run(launch_here, tmp_path, d)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "config error" in run.stderr and "model.path" in run.stderr
    assert str(file) in run.stderr and "truncated" in run.stderr and "Traceback" not in run.stderr


def test_a_header_claiming_4_eib_is_a_config_error(tmp_path, launch_here):
    d = model_dir(tmp_path / "m")
    file = d / "model.safetensors"
    with open(file, "r+b") as f:
        f.write(struct.pack("<Q", 4 << 60))
    run = dry_run(launch_here, tmp_path, d)
    assert run.returncode == 2 and str(file) in run.stderr and "4,611,686,018,427,387,904" in run.stderr, run.stderr


def test_offsets_past_the_end_and_missing_shards_are_named(tmp_path):
    from grpo_launcher.spec.safetensors_check import header_problem, missing_shards

    f = tmp_path / "x.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)  # 8 of the 16 bytes the header claims
    assert "ends at byte 16 of the data but the file holds 8" in header_problem(f)
    f.write_bytes(struct.pack("<Q", len(header)) + header[:-3] + b"   " + b"\0" * 16)
    assert "not valid JSON" in header_problem(f)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-2-of-2.safetensors"}}))
    assert missing_shards(tmp_path) == ["model-2-of-2.safetensors"]
