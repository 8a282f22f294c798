"""`launch.py generate`'s prompts, checked before any worker starts."""

from __future__ import annotations

from helpers import tiny_model


def test_an_empty_prompt_is_a_config_error(launch_here, tmp_path):
    """--prompt '' on a model without a chat template is no token at all: the workers started, then one died with
    torch's 'Expected tensor for argument #1 indices to have ... Long' traceback."""
    r = launch_here(tmp_path, "generate", str(tiny_model()), "--prompt", "1234>", "--prompt", "")
    assert r.returncode == 2 and r.stderr.startswith("config error"), r.stdout + r.stderr
    assert "  - --prompt: --prompt '' is no token as the model gets it" in r.stderr
    assert "sampling" not in r.stdout and "Traceback" not in r.stderr
