"""Batched autoregressive generation over the target's static KV cache (no draft).

One batch: a padded prefill of every prompt, then one decode forward per step for the whole batch
until each sequence has hit a stop token or `max_new_tokens`. Finished rows ride along as padding
(they write to the cache's dummy slot and their outputs are ignored), so the batch keeps its shape.

    prefill  tokens [b, max_prompt]   positions [b, max_prompt]   valid = position < prompt_len
    decode   tokens [b, 1]            positions = tokens in cache  valid = not finished

Host-side bookkeeping (lengths, finished flags) is plain Python: one device->host copy of the new
tokens per step, which also marks the step's end for the timings (TTFT, TPOT).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from engine.errors import ConfigError
from engine.model import LlamaModel, StaticKVCache
from engine.sampling import SamplingParams, sample


@dataclass
class SequenceResult:
    tokens: list[int]  # generated tokens (the stop token included when it ended the sequence)
    prompt_len: int
    ttft_s: float  # batch start -> first token on the host
    decode_s: float  # first token -> last token
    finish_reason: str  # "stop" | "length"

    @property
    def tpot_s(self) -> Optional[float]:
        n = len(self.tokens)
        return self.decode_s / (n - 1) if n > 1 else None


def check_capacity(prompt_lens: list[int], max_new_tokens: int, max_seq_len: int) -> None:
    worst = max(prompt_lens)
    if worst + max_new_tokens > max_seq_len:
        raise ConfigError(
            "model.max_seq_len", max_seq_len,
            f"a prompt of {worst} tokens + eval.max_new_tokens={max_new_tokens} does not fit the KV cache",
            f">= {worst + max_new_tokens}, or a smaller eval.max_new_tokens",
        )


@dataclass
class CacheRows:
    """The first `n` rows of a StaticKVCache, sharing its storage (a batch smaller than the cache)."""

    k: Tensor
    v: Tensor
    max_seq_len: int
    dummy_slot: int = field(init=False)

    def __post_init__(self):
        self.dummy_slot = self.max_seq_len

    @classmethod
    def of(cls, cache: StaticKVCache, n: int) -> "CacheRows":
        return cls(cache.k[:, :n], cache.v[:, :n], cache.max_seq_len)


class Generator:
    """Greedy or sampled generation for batches of up to `batch_size` prompts."""

    def __init__(self, model: LlamaModel, batch_size: int):
        self.model, self.batch_size = model, batch_size
        self.cache = model.new_cache(batch_size)
        self.device = model.lm_head.weight.device

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        generator: Optional[torch.Generator] = None,
        on_step: Optional[Callable[[], None]] = None,
    ) -> list[SequenceResult]:
        b = len(prompts)
        if not 0 < b <= self.batch_size:
            raise ValueError(f"batch of {b} prompts; this generator holds 1..{self.batch_size}")
        lens = [len(p) for p in prompts]
        if min(lens) == 0:
            raise ValueError("empty prompt")
        check_capacity(lens, params.max_new_tokens, self.model.max_seq_len)
        cache, dev = CacheRows.of(self.cache, b), self.device
        stop = frozenset() if params.ignore_eos else stop_ids

        t0 = time.perf_counter()
        width = max(lens)
        tokens = torch.zeros(b, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        positions = torch.arange(width).expand(b, width)  # [b, width]
        valid = positions < torch.tensor(lens)[:, None]
        out = self.model(
            tokens.to(dev), positions.to(dev), cache, valid=valid.to(dev), kv_len=width,
            logits_index=torch.tensor(lens, device=dev) - 1,
        )
        nxt = sample(out.logits[:, -1], params, generator)  # [b]

        outs: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        first_t = [0.0] * b
        last_t = [0.0] * b
        lengths = list(lens)  # tokens in the cache per row
        step = 0
        while True:
            host = nxt.tolist()  # the step's only sync
            now = time.perf_counter()
            step += 1
            for i, tok in enumerate(host):
                if done[i]:
                    continue
                outs[i].append(tok)
                first_t[i] = first_t[i] or now
                last_t[i] = now
                if tok in stop or len(outs[i]) >= params.max_new_tokens:
                    done[i] = True
            if on_step is not None:
                on_step()
            if all(done):
                break
            live = [not d for d in done]
            pos = torch.tensor(lengths, device=dev)[:, None]  # [b, 1]
            out = self.model(
                nxt[:, None], pos, cache, valid=torch.tensor(live, device=dev)[:, None],
                kv_len=max(l for l, a in zip(lengths, live) if a) + 1,
            )
            lengths = [l + a for l, a in zip(lengths, live)]
            nxt = sample(out.logits[:, -1], params, generator)

        return [
            SequenceResult(
                tokens=outs[i], prompt_len=lens[i], ttft_s=first_t[i] - t0, decode_s=last_t[i] - first_t[i],
                finish_reason="stop" if outs[i][-1] in stop else "length",
            )
            for i in range(b)
        ]
