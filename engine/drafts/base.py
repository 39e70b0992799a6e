"""The draft interface every algorithm implements, and the state the speculative loop shares with it.

Round structure (chain drafting, k = num_steps), per sequence with `L` tokens in the target cache and
its last emitted token `x_L` not yet in it:

    propose(state, k)   -> draft tokens d_1..d_k               [batch, k] (+ their probs [batch, k, vocab])
    target verify       on [x_L, d_1..d_k] at positions L..L+k   -> features [batch, k+1, F]
    accept a of them; emit d_1..d_a and the bonus token
    commit(state, ...)  the draft catches up on the a+1 verified positions (its "draft extend")

`begin` is the draft's prefill after the target's. With `rows=slice(i, j)` it prefills rows i..j-1 of a
batch of `batch_size` rows and leaves every other row's draft state (KV cache, carried hidden
states, pending proposal) as it was: requests join a running batch between rounds this way
(continuous batching). `rows=None` starts a fresh batch made of exactly these prompts. Drafts that read target features declare which
(`FeatureKind`): `aux` (EAGLE3: concatenated aux layers) or `final` (EAGLE: the final normed hidden
state); `none` for weightless drafts (n-gram, oracle).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


class FeatureKind(str, enum.Enum):
    none = "none"
    final = "final"  # target's final normed hidden states [b, t, hidden]
    aux = "aux"  # target's aux hidden states, concatenated [b, t, hidden * n_aux]


@dataclass
class SpecState:
    """Host-side view of the batch, kept by the speculative loop."""

    history: list[list[int]]  # per row: prompt + emitted tokens (the last one not yet in the cache)
    lengths: list[int]  # per row: tokens in the target cache (= position of the last emitted token)
    live: list[bool]  # rows still generating
    row_ids: list[int]  # index of each row's prompt in the whole prompt set (for the oracle)
    device: object = None
    _staged: Optional[tuple] = field(default=None, repr=False)  # (host key, pinned [2, b], device [2, b])

    def on_device(self) -> tuple[Tensor, Tensor]:
        """(lengths [b] int64, live [b] bool) on the device, as of now.

        One non-blocking copy from a pinned buffer when the host lists changed (once per round), shared
        by the draft and the verify of the round. Reusing the buffer is safe: every round ends with a
        device->host sync, so the previous copy has completed before the buffer is written again.
        """
        key = (tuple(self.lengths), tuple(self.live))
        if self._staged is None or self._staged[0] != key:
            pinned = self._staged[1] if self._staged is not None else torch.empty(
                2, len(self.lengths), dtype=torch.long,
                pin_memory=getattr(self.device, "type", "cpu") == "cuda")
            pinned[0] = torch.tensor(self.lengths)
            pinned[1] = torch.tensor(self.live)
            self._staged = (key, pinned, pinned.to(self.device, non_blocking=True))
        both = self._staged[2]
        return both[0], both[1].bool()


@dataclass
class Proposal:
    tokens: Tensor  # [b, k] int64, target vocabulary
    probs: Optional[Tensor] = None  # [b, k, vocab] draft distribution; None: deterministic (one-hot)


def put_rows(state: Optional[Tensor], value: Optional[Tensor], rows: Optional[slice], batch_size: int,
             dim: int = 0) -> Optional[Tensor]:
    """Per-row draft state (a carried hidden state, a pending proposal) after a prefill or commit:
    `value` itself when rows=None (a fresh batch of exactly these rows), else `state` with `value`
    written into `rows` along the batch dim `dim` of a batch_size-row tensor (zero-filled when the
    state is missing or not that big yet; the other rows keep theirs)."""
    if rows is None or value is None:
        return value
    if state is None or state.shape[dim] != batch_size:
        shape = list(value.shape)
        shape[dim] = batch_size
        state = value.new_zeros(shape)
    state[(slice(None),) * dim + (rows,)] = value
    return state


def cache_and_runners(head, batch_size: int, graphs, phases: list[str]) -> tuple[object, list]:
    """A head-based draft's KV cache and graph runners: with a graph set, the set's draft cache (its
    graphs replay over those addresses) and the runners of `phases` (None where not captured);
    without, a cache of its own and no runners (every forward eager)."""
    if graphs is not None and graphs.draft_cache is not None:
        return graphs.draft_cache, [graphs.get(name) for name in phases]
    return head.new_cache(batch_size), [None] * len(phases)


class Draft:
    """Base class: weightless drafts override `propose` only."""

    features: FeatureKind = FeatureKind.none

    def begin(self, state: SpecState, feats: Optional[Tensor], prompt_tokens: Tensor, valid: Tensor,
              input_embeds: Optional[Tensor], first: Tensor, rows: Optional[slice] = None) -> None:
        """Draft prefill. prompt_tokens/valid [n, T]; feats [n, T, F]; input_embeds [n, T, H] (the
        target's, reused for prompt positions); first [n]: the target's first emitted token.
        rows: the batch rows these n prompts occupy (None: they are the whole batch)."""

    def propose(self, state: SpecState, k: int) -> Proposal:
        raise NotImplementedError

    def commit(self, state: SpecState, feats: Optional[Tensor], emitted: Tensor, accepted: Tensor) -> None:
        """Draft extend, called before `state` advances (state.lengths[r] = L, the verify's first
        position). emitted [b, k+1]: d_1..d_a then the bonus at index a (the rest is garbage);
        accepted [b] = a; feats [b, k+1, F] at positions L..L+k."""
