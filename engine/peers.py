"""Peers: other ways to generate from the same weights, timed on the same prompts in the same job.

Each peer takes the loaded target, the tokenized prompts and the sampling params, and returns its
generated tokens and wall time, so that eval can log `peer_tokens_per_s.<name>` and our ratio to it
side by side. Registered peers:

    hf_generate       transformers `generate` with its default dynamic cache, batched with left padding
    hf_static_compile the same with `cache_implementation="static"`, whose decode step transformers
                      compiles with torch.compile (the warm-up pays the compilation)
    hf_prompt_lookup  transformers prompt-lookup decoding (`prompt_lookup_num_tokens=10`): n-gram drafts
                      from the prompt, verified by the model; batch size 1 (transformers' limit)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.generate import sync
from engine.loading import LoadedModel
from engine.sampling import SamplingParams


@dataclass
class PeerResult:
    outputs: list[list[int]]  # generated tokens per prompt (cut after the first stop token)
    wall_s: float  # generation time over all batches, warm-up excluded

    @property
    def generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def hf_model(loaded: LoadedModel, device: torch.device, dtype: torch.dtype):
    """A transformers model with the target's weights (same tensors' values, its own storage)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if loaded.hf_dir:
        model = AutoModelForCausalLM.from_pretrained(loaded.hf_dir, dtype=dtype)
    else:  # random-init target: mirror its args into a LlamaConfig and copy the weights
        a = loaded.model.args
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=a.vocab_size,
                hidden_size=a.hidden_size,
                intermediate_size=a.intermediate_size,
                num_hidden_layers=a.num_layers,
                num_attention_heads=a.num_heads,
                num_key_value_heads=a.num_kv_heads,
                head_dim=a.head_dim,
                rms_norm_eps=a.rms_norm_eps,
                rope_theta=a.rope_theta,
                tie_word_embeddings=a.tie_word_embeddings,
                max_position_embeddings=loaded.model.max_seq_len,
            )
        )
        model.load_state_dict(loaded.model.state_dict(), strict=False)
    return model.to(device=device, dtype=dtype).eval()


def _cut(tokens: list[int], stop: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def _hf_peer(extra: dict, max_batch: int | None = None) -> Callable[..., PeerResult]:
    """A transformers `generate` peer with `extra` generation kwargs."""

    @torch.inference_mode()
    def peer(
        loaded: LoadedModel,
        prompts: list[list[int]],
        params: SamplingParams,
        batch_size: int,
        stop_ids: frozenset[int],
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> PeerResult:
        model = hf_model(loaded, device, dtype)
        pad = next(iter(stop_ids), 0)
        batch_size = min(batch_size, max_batch or batch_size)

        def gen_kwargs(max_new: int) -> dict:
            kw = dict(max_new_tokens=max_new, pad_token_id=pad, do_sample=not params.greedy, **extra)
            if not params.greedy:
                kw.update(temperature=params.temperature, top_p=params.top_p, top_k=None)
            if params.ignore_eos:  # fixed-length benchmark: no stop token (min_new_tokens would mask EOS instead)
                kw.update(eos_token_id=None)
            else:
                kw.update(eos_token_id=sorted(stop_ids))
            return kw

        def run(batch: list[list[int]], max_new: int = params.max_new_tokens) -> list[list[int]]:
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(batch):  # left padding, as decoder-only generate expects
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **gen_kwargs(max_new))
            stop = frozenset() if params.ignore_eos else stop_ids
            return [_cut(row[width:].tolist(), stop) for row in out]

        torch.manual_seed(seed)
        run(prompts[:batch_size], max_new=8)  # warm-up (and compilation for the static cache)
        outputs, wall = [], 0.0
        for i in range(0, len(prompts), batch_size):
            sync(device)
            t0 = time.perf_counter()
            outputs += run(prompts[i : i + batch_size])
            sync(device)
            wall += time.perf_counter() - t0
        return PeerResult(outputs, wall)

    return peer


hf_generate = _hf_peer({})

PEERS: dict[str, Callable[..., PeerResult]] = {
    "hf_generate": hf_generate,
    "hf_static_compile": _hf_peer({"cache_implementation": "static"}),
    "hf_prompt_lookup": _hf_peer({"prompt_lookup_num_tokens": 10}, max_batch=1),
}
