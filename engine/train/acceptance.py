"""Held-out acceptance read from per-step greedy chains, in the alignment of engine/drafts/train_contract.py
(the batch, the forwards' logits and the loss every draft shares).

`chain_lengths` turns the per-step greedy matches into the drafts a chain anchored at each j gets
accepted; `chain_acceptance` averages them over anchors (the per-position estimate: accept_rate_pos_i,
accept_length at k drafts) and `simulated_loop` replays the greedy loop on them (rounds start where the
previous one stopped: what the eval stage reports), on held-out samples.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from engine.drafts.train_contract import Batch, shift_left


@torch.no_grad()
def chain_lengths(logits: list[Tensor], batch: Batch, k: int) -> Tensor:
    """Drafts a greedy chain of k anchored at j gets accepted (teacher-forced tokens) -> [B, T] int64.

    Step s of the chain at anchor j is logits[s] at p = j + s; it counts while every step before it
    was right and its label is a trained answer token."""
    b, t = batch.mask.shape
    ok = torch.ones(b, t, dtype=torch.bool, device=batch.mask.device)
    length = torch.zeros(b, t, dtype=torch.long, device=batch.mask.device)
    for s in range(min(k, len(logits))):
        right = (logits[s].argmax(-1) == batch.top) & batch.mask  # [B, T] at position p = j + s
        ok = ok & shift_left(right, s)  # [B, T] indexed by anchor j
        length += ok
    return length


@torch.no_grad()
def chain_acceptance(length: Tensor, mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Greedy chain drafting of k tokens from every anchor whose k positions are all trained on.

    length [B, T] (chain_lengths over k steps), mask [B, T]
    -> (accepted [k]: chains whose drafts 1..i+1 were all right, i.e. the count behind
        accept_rate_pos_i; anchors: the number of chains). accept_length = 1 + sum(accepted) / anchors.
    """
    t = mask.shape[1]
    usable = mask.clone()
    for s in range(1, k):
        usable[:, : t - s] &= mask[:, s:]
    usable[:, t - k + 1 :] = False  # [B, T] anchors with all k positions in the row and trained on
    return torch.stack([((length > i) & usable).sum() for i in range(k)]), usable.sum()


def _trained_span(mask: Tensor) -> tuple[Tensor, Tensor]:
    """mask [B, T] -> (first trained position [B] (T when none), one past the last [B] (0 when none))."""
    pos = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask, pos, mask.shape[1]).amin(1), torch.where(mask, pos, -1).amax(1) + 1


def loop_anchors(length: Tensor, mask: Tensor, horizon: Optional[int] = None) -> Tensor:
    """Where the greedy draft-and-verify loop, replayed on teacher-forced chain lengths, starts its rounds.

    At inference a round anchored at j commits its accepted drafts plus the target's bonus token and the
    next round is anchored at j + accepted + 1; the first round follows the prompt (anchor p0 + 1, with
    p0 the first trained position: the first answer token comes from the prefill). Since the samples are
    the target's greedy answers, this is the loop's own sequence of rounds, without running it.
    `horizon` is the loop's max_new_tokens (the prefill's token included): no round starts past it.

    The rounds of a row are a path in the graph j -> j + length[j] + 1 (rounds at or past the row's end
    go to a sink, node T). The path from the first anchor is marked by pointer doubling, on the device and
    without a host sync: after level i the marks hold the path's first 2^i nodes, and level i + 1 adds
    their images under the 2^i-th power of the jump (the jump then squared by one gather); ceil(log2(T+1))
    levels cover any path. About 30 small kernels for a batch, instead of a Python walk per row.

    length [B, T] (chain_lengths), mask [B, T] -> anchors [B, T] bool, on length's device
    """
    b, t = mask.shape
    pos = torch.arange(t, device=length.device)
    first, stop = _trained_span(mask)  # [B]: rounds anchor in first + 1 .. stop - 1
    end = stop if horizon is None else torch.minimum(stop, first + horizon)  # [B]
    jump = torch.cat([pos + length + 1, length.new_full((b, 1), t)], 1)  # [B, T+1], node T: the sink
    jump = torch.where(jump < end[:, None], jump, t)
    start = torch.where((mask.sum(1) >= 2) & (first + 1 < end), first + 1, t)  # [B]
    marks = torch.zeros(b, t + 1, dtype=torch.uint8, device=length.device)
    marks[torch.arange(b, device=length.device), start] = 1
    for _ in range(max(1, math.ceil(math.log2(t + 1)))):
        marks = marks.scatter_reduce(1, jump, marks, "amax")  # keeps its own marks, adds their images
        jump = jump.gather(1, jump)
    return marks[:, :t].bool()


def simulated_loop(length: Tensor, mask: Tensor, horizon: Optional[int] = None) -> tuple[int, int, Tensor]:
    """The greedy loop replayed on teacher-forced chain lengths (`loop_anchors`): the round that crosses
    `horizon` counts its whole acceptance, as the eval stage counts a verify. Late tokens of long greedy
    answers (repetition) are the easiest to draft, so the figure depends on the horizon; the eval stage
    generates 256.

    length [B, T] (chain_lengths), mask [B, T] -> (tokens: accepted + 1 summed over rounds, rounds,
    anchors [B, T] bool, on length's device)
    """
    anchors = loop_anchors(length, mask, horizon)
    pos = torch.arange(mask.shape[1], device=length.device)
    _, stop = _trained_span(mask)
    tokens = torch.minimum(length + 1, stop[:, None] - pos)[anchors].sum()
    return int(tokens), int(anchors.sum()), anchors
