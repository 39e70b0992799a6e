"""Token sampling: greedy, or temperature with nucleus (top-p) filtering.

    logits [batch, vocab] -> tokens [batch] int64

Sampling draws with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which equals a draw
from p, needs no host sync, and takes an explicit `torch.Generator` so runs are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 256
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def probs_from_logits(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """[batch, vocab] logits -> [batch, vocab] float32 probabilities after temperature and top-p."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None) -> Tensor:
    """logits [batch, vocab] -> next tokens [batch]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = probs_from_logits(logits, params.temperature, params.top_p)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)
