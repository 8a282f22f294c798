"""Stop tokens as the checkpoint defines them (issue 42, item 1): tokenizer EOS ∪ generation_config's eos_token_id.

Tiny checkpoints in the style of families whose end-of-turn token is listed only in generation_config.json (Qwen3,
Llama-3, Gemma-it, Phi-3), built with save_pretrained and a byte-level tokenizer carrying the family's special
tokens. Each model is made to say its end-of-turn token mid-answer: its greedy continuation is read first, then the
ids of the k-th greedy token and of the end-of-turn token are swapped in the embeddings (a relabelling: the model
computes the same function, only the two ids trade names), so greedy decoding emits the end-of-turn token at step k.
rollout=hf, at a temperature where sampling is greedy, must stop exactly where `transformers.generate` stops (before
this fix it stopped at the tokenizer's EOS only and ran every sample to rollout.max_new_tokens).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from grpo_launcher.rollout.hf import HFEngine
from grpo_launcher.spec.schema import RolloutBackend
from grpo_launcher.stop_tokens import stop_token_ids
from helpers import ROOT
from unit.test_stop_tokens import GREEDY
from unit.test_stop_tokens import checkpoints  # noqa: F401  (fixtures)


VLLM_ENGINES = """
import json, pickle, sys
from safetensors.torch import load_file
from grpo_launcher.rollout.vllm import VLLMRolloutWorker

spec = pickle.loads(open(sys.argv[1], "rb").read())
for d, prompt in json.loads(sys.argv[2]):
    w = VLLMRolloutWorker(spec, d, max_model_len=128)
    w.update_weights(load_file(d + "/model.safetensors"))  # dummy weights until the refit, as the driver does
    g = w.generate([prompt], 1, 0)[0]
    print("RESULT", json.dumps([d, g.response_ids, g.truncated, w.stop_ids]), flush=True)
    w.shutdown()
"""


@pytest.mark.slow
@pytest.mark.extended
def test_vllm_stops_at_the_same_token(checkpoints, tmp_path):
    """rollout=vllm (the CPU build, in a process of its own; one engine per style in turn) ends each sample where
    rollout=hf does, on the generation config's end-of-turn token, with the same explicit stop set."""
    import pickle

    from grpo_launcher.train.workers import WORKER_ENV

    styles = ["qwen3", "llama3", "gemma_it", "phi3"]
    spec = dataclasses.replace(GREEDY, rollout=dataclasses.replace(GREEDY.rollout, backend=RolloutBackend.vllm))
    (tmp_path / "spec.pkl").write_bytes(pickle.dumps(spec))
    todo = [[str(checkpoints[s][0]), checkpoints[s][1]] for s in styles]
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, "-c", VLLM_ENGINES, str(tmp_path / "spec.pkl"), json.dumps(todo)],
                         capture_output=True, text=True, timeout=900, env=env)
    got = {d: rest for d, *rest in (json.loads(x[7:]) for x in run.stdout.splitlines() if x.startswith("RESULT "))}
    assert len(got) == len(styles), run.stdout[-2000:] + run.stderr[-3000:]
    for style in styles:
        d, prompt, turn_end = checkpoints[style]
        hf = HFEngine(GREEDY, str(d), torch.device("cpu")).generate([prompt], 1, seed=0)[0].response_ids
        ids, truncated, stops = got[str(d)]
        assert ids == hf and ids[-1] == turn_end and not truncated, (style, ids, hf)
        assert stops == list(stop_token_ids(d)), style
