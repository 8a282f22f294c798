"""rollout=hf: transformers `generate` inside the policy worker (a hybrid engine, as verl's), or (HFRolloutWorker)
as an engine of its own when cluster.rollout_devices > 0 (non-colocated; what async GRPO needs).

The policy worker owns an `HFEngine` and generates with its own weights: on a CPU in fp32 the engine
*is* the policy model (no second copy, nothing to refit); on a GPU it is a copy in the run's precision
(bf16 for train.precision=bfloat16) that a refit overwrites in place on the device, in milliseconds.

On a CPU, decoding (`sample`) is a plain loop over the model's forward with a KV cache: each distinct prompt
is prefilled ONCE and its cache repeated for its n samples (GRPO's group shares the prompt), and tokens are
drawn by the Gumbel-max trick from softmax(logits / T), whose log-probabilities are returned as they are.
No logits processors: on the tiny model this is faster than `generate`. Both paths stop at the checkpoint's stop
set (stop_tokens.py: tokenizer EOS ∪ generation_config eos_token_id, the set vLLM gets) and keep the stop token as
the completion's last token, as vLLM does.
On CUDA `generate` stays: there the loop was the slower (figures: benchmarks/results/gpu_step.md). With `rollout.hf_compile=true` it uses transformers' static KV cache, whose forward
`generate` compiles with torch.compile(mode="reduce-overhead") — CUDA graphs, so the per-token Python
cost that bounds eager decoding of small models goes away. Prompt widths are bucketed so that the
cache (and the captured graphs) keep one shape from step to step.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

import torch

from ..models.attention import hf_attention
from ..models.nemotron_h import bind_mamba_kernels
from ..models.rope import pin_longrope
from ..plan import engine_max_model_len
from ..spec.schema import RunSpec
from ..batch import Generation
from ..stop_tokens import stop_token_ids
from .versions import VersionedEngine

WIDTH_BUCKET = 64  # compiled decoding: left-pad prompts to a multiple of this (one cache shape per bucket)
WIDTH_MULTIPLE = 16  # eager decoding on CUDA: prompts left-padded to a multiple of this


class SampledLogprobs:
    """A logits processor that keeps log p(token) of every sampled token under softmax(logits / T).

    Called once per decoding step with that step's raw scores; the token sampled from step t is visible
    (as input_ids[:, -1]) at step t + 1, so only one [B, V] row of log-probabilities is ever held.
    `generate` applies its own temperature warper after user processors: the division here is ours.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.prev: torch.Tensor | None = None  # [B, V] log-probs of the last step
        self.picked: list[torch.Tensor] = []  # per step [B, 1]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.picked.append(self.prev.gather(-1, input_ids[:, -1:]))
        self.prev = (scores.float() / self.temperature).log_softmax(-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] log-probs, given the last sampled token of each row [B]."""
        self.picked.append(self.prev.gather(-1, last_tokens[:, None]))
        return torch.cat(self.picked, 1)


class HFEngine:
    def __init__(self, spec: RunSpec, model_dir: str, device: torch.device, model=None):
        from transformers import AutoModelForCausalLM  # here: the driver imports this module, not transformers

        self.spec, self.device, self.model_dir = spec, device, model_dir
        self._tokenizer = None
        self._stop: tuple[int, ...] | None = None
        self.shared = model is not None  # the policy's own model: nothing to refit
        if model is None:  # a separate inference copy in the run's precision, refit in place
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine_dtype(spec, device),
                                                         **hf_attention(model_dir)).to(device)  # models/attention.py
            pin_longrope(model, engine_max_model_len(spec))  # as the policy's copy (models/rope.py)
        self.model = model
        bind_mamba_kernels(model, on_cuda=device.type == "cuda")  # nemotron_h: no Triton kernel on CPU tensors
        self.compiled = device.type == "cuda" and spec.rollout.hf_compile

    @property
    def tokenizer(self):
        """Loaded on first use (pad/eos for generate): a worker that never generates needs none."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The checkpoint's stop tokens (stop_tokens.py), resolved on first use."""
        if self._stop is None:
            self._stop = stop_token_ids(self.model_dir, self.tokenizer)
        return self._stop

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, seed: int) -> list[Generation]:
        """n samples per prompt, grouped: rows [k*n, (k+1)*n) belong to prompt k."""
        r = self.spec.rollout
        torch.manual_seed(seed)
        pad, stop = self.tokenizer.pad_token_id, self.stop_ids
        rows = [p for p in prompt_ids for _ in range(n)]
        was_training = self.model.training
        self.model.eval()
        try:
            if self.device.type == "cpu":
                new, tok_lp = sample(self.model, prompt_ids, n, r.temperature, r.max_new_tokens, pad, stop)
            else:
                new, tok_lp = self._generate_hf(rows, pad, stop)
        finally:
            self.model.train(was_training)
        new, tok_lp = new.cpu(), tok_lp.cpu()
        return [_one(rows[i], new[i], tok_lp[i], stop) for i in range(len(rows))]

    def _generate_hf(self, rows: list[list[int]], pad: int, stop: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """CUDA: transformers' `generate` (rollout.hf_compile=true: a static cache, prompts padded to a bucket)."""
        from transformers import GenerationConfig  # (the same)

        r = self.spec.rollout
        bucket = WIDTH_BUCKET if self.compiled else WIDTH_MULTIPLE  # (policy/microbatch.widened: Triton's
        width = -(-max(map(len, rows)) // bucket) * bucket  # kernels compiled once for every prompt width)
        ids, attn = left_padded(rows, pad, width, self.device)
        rec = SampledLogprobs(r.temperature)
        gen = GenerationConfig(do_sample=True, temperature=r.temperature, top_k=0, top_p=1.0,
                               max_new_tokens=r.max_new_tokens, pad_token_id=pad, eos_token_id=list(stop))
        # generate fills what `gen` leaves unset from model.generation_config (generation_config.json: a
        # repetition_penalty, min_p ...), which would bend the distribution away from softmax(logits / T), the one
        # the logprobs and the policy describe: none of it but the stop set, and the model's own is put back (export)
        own, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            out = self.model.generate(
                input_ids=ids, attention_mask=attn, generation_config=gen, logits_processor=[rec],
                **({"cache_implementation": "static"} if self.compiled else {"disable_compile": True}))
        finally:
            self.model.generation_config = own
        new = out[:, width:]  # [B, T]
        return new, rec.finish(new[:, -1])

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Refit: copy HF-named tensors into the engine's parameters in place (any device, any dtype). `state`: a
        dict, or (name, tensor) pairs consumed one at a time (a sharded policy gathers each as it is asked for)."""
        own = self.model.state_dict()
        seen = set()
        for k, v in state.items() if isinstance(state, dict) else state:
            own[k].copy_(v, non_blocking=True)
            seen.add(k)
        missing = [k for k in own if k not in seen and not k.endswith("rotary_emb.inv_freq")]
        if missing:
            raise KeyError(f"refit is missing {len(missing)} weights, e.g. {missing[:3]}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class HFRolloutWorker(VersionedEngine):
    """rollout=hf as an engine of its own (cluster.rollout_devices > 0: non-colocated, async GRPO): an HFEngine
    with its own model copy on its own device slot, refit by state dict (the contract of rollout/vllm.py)."""

    def __init__(self, spec: RunSpec, model_dir: str, threads: int = 1, max_model_len: int | None = None):
        del max_model_len  # the Plan's engine context (vLLM's contract): generation is bounded by max_new_tokens
        self.startup_marks = [("imports", time.time())]  # (phase, its end): the driver's start-up line (train/startup.py)
        import transformers.models.auto.modeling_auto  # noqa: F401  (HFEngine's import, timed on its own)

        self.startup_marks.append(("transformers", time.time()))
        torch.set_num_threads(threads)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.engine = HFEngine(spec, str(model_dir), device)  # the driver refits before the first rollout
        self._versions_init()
        self.startup_marks.append(("engine", time.time()))

    def generate(self, prompt_ids: list[list[int]], n: int, seed: int) -> list[Generation]:
        self._apply_staged()
        return self.engine.generate(prompt_ids, n, seed)

    def update_weights(self, state_dict: dict, version: int | None = None) -> float:
        """HF-named tensors → the engine's parameters in place. Returns ms."""
        t0 = time.perf_counter()
        self.engine.load_weights(state_dict)
        if version is not None:
            self.version = version
        return (time.perf_counter() - t0) * 1e3

    def http_url(self) -> None:
        return None  # no HTTP server for the HF engine (rollout.expose_http_server is vLLM's)

    def shutdown(self) -> None:
        pass


@torch.no_grad()
def sample(model: torch.nn.Module, prompts: list[list[int]], n: int, temperature: float, max_new: int, pad: int,
           stop: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples of each prompt → (tokens [P*n, T], their log-probs [P*n, T]), rows grouped by prompt.

    A row ends at its first token in `stop` (kept); its tokens after that are padding (and their log-probs
    meaningless): `_one` cuts there.
    """
    from transformers import DynamicCache  # (the same)

    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids, attn = left_padded(prompts, pad, width, device)  # [P, W]
    cache = DynamicCache(config=model.config)  # hybrids (nemotron_h): Mamba layers get their conv/SSM state
    # a Mamba layer's state cannot be repeated (transformers 5.19): each sample prefills its prompt. A layer holding
    # both (falcon_h1's LinearAttentionAndFullAttentionLayer) inherits the attention's repeat, which leaves its
    # conv / SSM states at the prompt count: the tiny falcon_h1 stopped at its first decoding step
    rep = n if all(hasattr(layer, "batch_repeat_interleave") and not hasattr(layer, "conv_states")
                   for layer in cache.layers) else 1
    if rep == 1:
        ids, attn = ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                   past_key_values=cache, logits_to_keep=1).logits[:, -1]  # [P, V]
    if rep > 1:
        cache.batch_repeat_interleave(n)  # every sample of a prompt starts from the same prefix
    logits = logits.repeat_interleave(rep, 0)  # [B, V], B = P*n
    mask = torch.ones(len(logits), width + max_new, dtype=attn.dtype, device=device)
    mask[:, :width] = attn.repeat_interleave(rep, 0)
    pos = attn.sum(-1).repeat_interleave(rep, 0)  # [B] position of the next token
    done = torch.zeros(len(logits), dtype=torch.bool, device=device)
    stops = torch.tensor(list(stop), dtype=torch.long, device=device)  # [S]
    tokens, logprobs = [], []
    for t in range(max_new):
        lp = (logits.float() / temperature).log_softmax(-1)  # [B, V]
        gumbel = torch.rand_like(lp).log_().neg_().log_().neg_()  # -log(-log U): argmax(lp + g) ~ softmax
        nxt = torch.where(done, pad, (lp + gumbel).argmax(-1))  # [B]
        tokens.append(nxt)
        logprobs.append(lp.gather(-1, nxt[:, None])[:, 0])
        done |= torch.isin(nxt, stops)
        if t + 1 == max_new or bool(done.all()):
            break
        logits = model(input_ids=nxt[:, None], attention_mask=mask[:, : width + t + 1],
                       position_ids=(pos + t)[:, None], past_key_values=cache).logits[:, -1]
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


def load_tokenizer(model_dir: str) -> Any:
    """The checkpoint's tokenizer (AutoTokenizer). One without a pad token (Llama-3's, Mistral's) pads with its EOS,
    as NeMo-RL does: padding is told apart by lengths and attention masks here (batch.collate, `left_padded`), never
    by its id, so the pad token's identity does not matter."""
    from transformers import AutoTokenizer  # here: the driver imports this module, not transformers

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def left_padded(rows: list[list[int]], pad: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows → (ids [B, width] padded on the left, attention mask [B, width]): what decoding starts from."""
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
    return ids, attn


def engine_dtype(spec: RunSpec, device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" and spec.train.precision.value == "bfloat16" else torch.float32


def _one(prompt: list[int], tokens: torch.Tensor, lps: torch.Tensor, stop: Sequence[int]) -> Generation:
    """A row cut after its first stop token (kept, as vLLM keeps it); none: truncated at max_new_tokens."""
    toks = tokens.tolist()
    end = next((i + 1 for i, t in enumerate(toks) if t in stop), None)
    return Generation(prompt_ids=list(prompt), response_ids=toks[:end], logprobs=lps[:end].tolist(),
                      truncated=end is None)
