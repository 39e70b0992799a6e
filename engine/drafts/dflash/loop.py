"""The DFlash draft loop over `DFlashHead` (engine/drafts/dflash/head.py states the model and the cache
discipline): the prefill and each extend write context k/v, each proposal is one block forward."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from engine.drafts.base import DeviceDraft, FeatureKind
from engine.drafts.dflash.head import DFlashHead
from engine.ops import AttnInputs, Live
from engine.sampling import DRAFT, draw


class DFlashDraft(DeviceDraft):
    """The draft loop: `begin` and the extend write context k/v, the proposal runs one block forward.

    State per row: the context cache holds positions 0..L-1; the next block starts with x_L, the round's
    `last` (the bonus token): the draft keeps no buffers of its own but d_q [b, k, vocab] (a sampled
    round draws every block position i from the one forward's q_i, at position L+i, and keeps q_i).
    """

    features = FeatureKind.aux
    draws_at_prefill = False  # the round draws the whole block

    def __init__(self, head: DFlashHead, batch_size: int, k: int):
        if not 1 <= k < head.block_size:
            raise ValueError(
                f"draft.num_steps={k}: a DFlash block of {head.block_size} tokens proposes 1..{head.block_size - 1}"
            )
        super().__init__(head, batch_size, k)
        device = head.fc.weight.device
        self.offsets = torch.arange(head.block_size, device=device)  # [B] block index: constant, read by graphs
        self.is_bonus = self.offsets == 0  # [B] the block's first slot holds the bonus token, the rest masks

    # -- the Draft interface ------------------------------------------------------------------------
    def prefill(self, cache, feats, tokens, valid, embeds, first, draws=None, q=None, kv_len=None) -> dict[str, Tensor]:
        """Context k/v of the prompt positions 0..T-1 (the draft reads no prompt token: only features)."""
        b, t = tokens.shape
        positions = torch.arange(t, device=first.device).expand(b, t)
        self.head.write_context(feats.to(self.head.fc.weight.dtype), cache, self._context_inputs(positions, valid))
        return {}

    def _context_inputs(self, positions, valid) -> AttnInputs:
        h = self.head
        return AttnInputs.build(positions, valid, h.rope_cos, h.rope_sin, h.cache_slots, h.fc.weight.dtype)

    def propose_into(self, s, cache, k: int, kv_len: Live, sampled: bool = False) -> Optional[Tensor]:
        """One block forward on [x_L, m, ..., m] at L..L+B-1 -> d_1..d_k at block indices 1..k."""
        B = self.head.block_size
        tokens = torch.where(self.is_bonus, s.last[:, None], self.head.mask_token_id)  # [b, B]
        positions = s.lengths[:, None] + self.offsets  # [b, B]
        valid = s.live[:, None].expand(s.last.shape[0], B)
        a = self.head.block_inputs(positions, valid, kv_len + B, self.head.embed.weight.dtype)
        out = self.head(tokens, cache, a, k, sampled)
        if sampled:  # d_1..d_k at positions L+1..L+k, each from its own q
            ids = draw(
                out.logits,
                self.round_draws(s),
                s.lengths,
                DRAFT,
                kernels=self.head.fused,
                offset=1,
                q_out=s.q[:, :k],
            )
        else:
            ids = out.ids
        s.draft[:, :k].copy_(ids)  # [b, k]
        return out.logits  # [b, k, vocab] (None: the fused greedy path forms none)

    def extend(self, s, cache, v, kv_len: Live, sampled: bool = False) -> None:
        """Context k/v of the verified positions L..L+a (a = accepted; the rest to the dummy slot)."""
        k = v.emitted.shape[1] - 1
        steps = torch.arange(k + 1, device=v.accepted.device)
        valid = (steps[None] <= v.accepted[:, None]) & s.live[:, None]
        feats = v.feats.to(self.head.fc.weight.dtype)  # [b, k+1, F]
        self.head.write_context(feats, cache, self._context_inputs(s.lengths[:, None] + steps, valid))


def make_dflash(plan, head, ctx) -> DFlashDraft:
    return DFlashDraft(head, ctx.batch_size, ctx.k)
