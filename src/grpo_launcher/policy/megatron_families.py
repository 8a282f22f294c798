"""What the Megatron converter maps, readable without torch: pre-flight's rules ask it before any GPU work."""

from __future__ import annotations

CPU_SHIM_ENV = "GRPO_MEGATRON_CPU_SHIM"  # 1: megatron-core on CPU through policy/megatron_cpu.py (tests only)
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")  # HF model_type values megatron_convert maps
