"""rollout=hf: transformers `generate` in a worker; weights refit in place from the policy."""

from __future__ import annotations

import time

import torch

from ..spec.schema import RunSpec
from ..train.batch import Generation


class HFRolloutWorker:
    def __init__(self, spec: RunSpec, model_dir: str, threads: int = 1):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, seed: int) -> list[Generation]:
        """n samples per prompt, grouped: rows [k*n, (k+1)*n) belong to prompt k."""
        r = self.spec.rollout
        torch.manual_seed(seed)
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        rows = [p for p in prompt_ids for _ in range(n)]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])  # left-padded for generate
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        out = self.model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, temperature=r.temperature, top_k=0, top_p=1.0,
            max_new_tokens=r.max_new_tokens, pad_token_id=pad, eos_token_id=eos,
            return_dict_in_generate=True, output_scores=True)
        new = out.sequences[:, width:]  # [B, T]
        logp = torch.stack(out.scores, 1).float().log_softmax(-1)  # [B, T, V] of the sampling distribution
        tok_lp = logp.gather(-1, new[..., None]).squeeze(-1)
        return [self._one(rows[i], new[i], tok_lp[i], eos) for i in range(len(rows))]

    @staticmethod
    def _one(prompt: list[int], tokens: torch.Tensor, lps: torch.Tensor, eos: int) -> Generation:
        toks = tokens.tolist()
        end = toks.index(eos) + 1 if eos in toks else len(toks)
        return Generation(prompt_ids=list(prompt), response_ids=toks[:end], logprobs=lps[:end].tolist(),
                          truncated=eos not in toks)

    def update_weights(self, state_dict: dict) -> float:
        t0 = time.perf_counter()
        self.model.load_state_dict(state_dict, strict=True)
        return (time.perf_counter() - t0) * 1e3

    def shutdown(self) -> None:
        pass
