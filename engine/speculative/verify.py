"""Verification of a chain of k draft tokens against the target's k+1 verify logits.

    logits [b, k+1, vocab]  (position i scores the token after draft token i; i = 0: after x_L)
    draft  [b, k]           draft tokens, target vocabulary
    q      [b, k, vocab]    the draft's distribution of each token (None: a deterministic draft, q one-hot)
    -> accepted [b] (a: the number of leading draft tokens kept), bonus [b] (the token at index a)

Greedy (temperature 0): keep draft tokens while they equal the target's argmax; the bonus is the argmax
after the last kept one. The output is exactly the target's greedy output.

Sampling (temperature > 0): speculative rejection sampling. The draft drew d_i from its own q_i (the row's
temperature and top-p on the draft's logits); keep d_i with probability min(1, p_i(d_i) / q_i(d_i)); at
the first rejection draw the bonus from norm(max(0, p_a - q_a)); if all k survive draw it from p_k (k = 0,
plain sampled decoding: a draw from p_0). Each emitted token is then distributed exactly as the target's
(with the same temperature and top-p), whatever the draft proposes.

Per row: each row its own temperature, top-p and seed (greedy rows in a mixed batch keep the greedy rule
exactly), and a row with speculate False keeps no draft token: its bonus is what plain decoding emits.
In a round these rules run on the device (kernels/accept.py: greedy; kernels/sample.py: both, with
counter-based random numbers), each beside its plain-torch reference; `verify` runs them alone.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from engine.sampling import Draws
from kernels.accept import accept_greedy_reference as accept_greedy  # the greedy rule (plain torch)
from kernels.sample import accept, accept_reference


def verify_greedy(logits: Tensor, draft: Tensor) -> tuple[Tensor, Tensor]:
    return accept_greedy(logits.argmax(-1), draft)


def verify(
    logits: Tensor,
    draft: Tensor,
    q: Optional[Tensor],
    draws: Draws,
    lengths: Tensor,
    speculate: Optional[Tensor] = None,
    vocab_map: Optional[Tensor] = None,
    kernels: bool = False,
) -> tuple[Tensor, Tensor]:
    """Either rule per row (draws: temperature 0 is greedy); draft token i sits at position lengths + 1 + i.
    vocab_map [vocab]: each target id's index in q's vocabulary (-1: outside it; None: the same)."""
    b, k1, _ = logits.shape
    out = torch.empty(b, k1 + 1, dtype=torch.long, device=logits.device)
    if speculate is None:
        speculate = torch.ones(b, dtype=torch.bool, device=logits.device)
    fn = accept if kernels else accept_reference
    accepted, bonus = fn(
        logits, draft, q, vocab_map, draws.temperature, draws.top_p, draws.seed, lengths, speculate, out
    )
    return accepted.clone(), bonus
