"""Verification of a chain of k draft tokens against the target's k+1 verify logits.

    logits [b, k+1, vocab]  (position i scores the token after draft token i; i = 0: after x_L)
    draft  [b, k]           draft tokens, target vocabulary
    q      [b, k, vocab]    the draft's distribution (None: a deterministic draft, q one-hot)
    -> accepted [b] (a: the number of leading draft tokens kept), bonus [b] (the token at index a)

Greedy: keep draft tokens while they equal the target's argmax; the bonus is the argmax after the
last kept one. The output is exactly the target's greedy output.

Sampling (temperature > 0): speculative rejection sampling. Keep d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw the bonus from norm(max(0, p_a - q_a));
if all k survive draw it from p_k (k = 0, plain sampled decoding: a draw from p_0). Each emitted token
is then distributed exactly as the target's (with the same temperature and top-p), whatever the draft
proposes.

Per row (`engine.sampling.RowSampling`, serve: every request its own setting): greedy rows take the
greedy rule, the others rejection sampling with their own temperature / top-p / generator; a
batch of only greedy rows runs the greedy rule alone (no probabilities, no random numbers).

speculate [b] bool (None: all): a row that does not speculate accepts none and its bonus is what a
k = 0 round emits (greedy: the argmax at position 0; sampled: a draw from p_0, its q masked to 0).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.sampling import RowSampling, SamplingParams, as_rows, probs_from_logits
from kernels.accept import accept_greedy_reference as accept_greedy  # the greedy rule (plain torch)


def verify_greedy(logits: Tensor, draft: Tensor, speculate: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return accept_greedy(logits.argmax(-1), draft, speculate)


def verify_sampling(
    logits: Tensor,
    draft: Tensor,
    q: Optional[Tensor],
    params: SamplingParams | RowSampling,
    generator: Optional[torch.Generator] = None,
    speculate: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    s = as_rows(params, generator)
    b, k1, vocab = logits.shape
    k = k1 - 1
    flat = s.repeat_rows(k1)  # each row's temperature / top-p for its k+1 positions
    p = probs_from_logits(logits.reshape(b * k1, vocab), flat.temperature, flat.top_p, s.any_top_p).view(b, k1, vocab)
    if k == 0:  # plain sampled decoding: nothing to accept or reject, the bonus is a draw from p itself
        return torch.zeros(b, dtype=torch.long, device=logits.device), s.race(p[:, 0])
    if q is None:
        q = F.one_hot(draft, vocab).to(p.dtype)  # [b, k, vocab]
    p_d = p[:, :k].gather(-1, draft[..., None])[..., 0]  # [b, k]
    q_d = q.gather(-1, draft[..., None])[..., 0].float()
    u = s.rand(b, k, logits.device)
    accepted = (u * q_d < p_d).int().cumprod(1).sum(1)  # [b]
    if speculate is not None:  # rows that do not speculate keep none; q_0 = 0 leaves p_0 as the residual
        accepted = accepted * speculate
        q = q * speculate[:, None, None]

    rows = torch.arange(b, device=logits.device)
    p_a = p[rows, accepted]  # [b, vocab]
    q_a = torch.cat([q.float(), torch.zeros_like(p[:, :1])], 1)[rows, accepted]  # zeros where a == k
    residual = (p_a - q_a).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_a)  # p == q exactly: draw from p
    return accepted, s.race(residual)


def verify(
    logits: Tensor,
    draft: Tensor,
    q: Optional[Tensor],
    params: SamplingParams | RowSampling,
    generator: Optional[torch.Generator] = None,
    speculate: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    s = as_rows(params, generator)
    if s.all_greedy:
        return verify_greedy(logits, draft, speculate)
    accepted, bonus = verify_sampling(logits, draft, q, s, speculate=speculate)
    if isinstance(s.greedy, Tensor):  # a mixed batch: greedy rows keep the greedy rule exactly
        g_accepted, g_bonus = verify_greedy(logits, draft, speculate)
        accepted = torch.where(s.greedy, g_accepted.to(accepted.dtype), accepted)
        bonus = torch.where(s.greedy, g_bonus, bonus)
    return accepted, bonus
