"""`FeatureDraft`: the draft loop shared by the EAGLE-family heads (EAGLE3, EAGLE).

State per row, after `begin` or a round's extend: the draft has processed positions 0..L-1 (L =
tokens in the target cache), and holds `d_hidden` (its output at L-1) and `d_next` (its first
proposal, d_1, a target id).

    begin    pairs (f_j, x_{j+1}) for prompt positions j = 0..L-1 (x_L: the target's first token);
             reuses the target's input embeddings for prompt positions when the prompt came as embeds
    propose  d_1 = d_next; step i = 1..k-1 at position L+i-1 on (h, d_i) -> d_{i+1}   (phase draft)
    extend   pairs (f_j, x_{j+1}) for the verified positions j = L..L+a (x: accepted tokens, then
             the bonus); overwrites the draft cache where the proposal steps wrote      (phase extend)

Each proposal is the argmax of the head's logits, or in a sampled round (sampled rows) a draw from its
q at the proposal's position (d_{i+1}: L+i+1; the extend's d_next: L+a+2; begin's: the prompt's length
+ 1), q kept in d_q[:, i] (d_next's in d_q[:, 0]).

State buffers (RoundState.own, b rows): d_hidden [b, hidden], d_next [b]; d_q [b, K, Vd] (RoundState.q).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from engine.drafts.base import DeviceDraft, FeatureKind
from engine.graphs.runner import InputSpec
from engine.ops import Live
from engine.sampling import DRAFT, Draws, draw


class FeatureDraft(DeviceDraft):
    def __init__(self, head, batch_size: int, k: int, features: FeatureKind):
        self.features = features
        super().__init__(head, batch_size, k)

    def own_specs(self, k: int) -> dict[str, InputSpec]:
        dtype = next(self.head.parameters()).dtype
        return {
            "d_hidden": InputSpec((self.head.args.hidden_size,), dtype, None, per_row=True, state=True),
            "d_next": InputSpec((), torch.long, None, per_row=True, state=True),
        }

    def prefill(self, cache, feats, tokens, valid, embeds, first, draws=None, q=None, kv_len=None) -> dict[str, Tensor]:
        b, t = tokens.shape
        last = valid.sum(1) - 1  # [b] index of each prompt's last token
        r = torch.arange(b, device=first.device)
        shifted = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)  # x_{j+1}; last column is filler
        shifted[r, last] = first
        if embeds is not None:  # the multimodal path: reuse the target's embeddings
            embeds = torch.cat([embeds[:, 1:], embeds[:, :1]], 1).clone()
            embeds[r, last] = self.head.embed_tokens(first)
        positions = torch.arange(t, device=first.device).expand(b, t)
        a = self.head.attn_inputs(positions, valid, t if kv_len is None else kv_len)
        sampled = draws is not None  # sampled rows draw d_1 (at position L + 1) from the head's q
        pick = lambda x: x[r, last][:, None]  # noqa: E731  the output head reads the last position alone
        out = self.head(feats, cache, a, tokens=shifted, embeds=embeds, sampled=sampled, pick=pick)
        nxt = self._draw(out.logits, draws, last, 2, q)[:, 0] if sampled else out.ids[:, 0]
        return {"d_hidden": out.hidden[:, 0], "d_next": nxt}  # [b, hidden], [b]

    def _draw(self, logits: Tensor, draws: Draws, pos0: Tensor, offset: int, q: Tensor, index=None) -> Tensor:
        """Target ids [b, 1 or t] drawn from the head's logits [b, t, Vd] at pos0 + offset (+ index), their q
        written into q."""
        return draw(
            logits,
            draws,
            pos0,
            DRAFT,
            kernels=self.head.fused,
            offset=offset,
            index=index,
            q_out=q,
            offsets=self.offsets,
        )

    def propose_into(self, s, cache, k: int, kv_len: Live, sampled: bool = False) -> Optional[Tensor]:
        """d_1 = d_next; step i = 1..k-1 at position L+i-1 on (h, d_i) -> d_{i+1} (into s.draft)."""
        tok, h, out = s.own["d_next"], s.own["d_hidden"], None  # [b], [b, hidden]
        s.draft[:, 0].copy_(tok)
        for i in range(1, k):  # step i at position L+i-1: kv_len + i covers it
            a = self.head.attn_inputs((s.lengths + i - 1)[:, None], s.live[:, None], kv_len + i)
            out = self.head(h[:, None], cache, a, tokens=tok[:, None], sampled=sampled)
            if sampled:  # d_{i+1} at position L+i+1, its q kept
                tok = self._draw(out.logits, self.round_draws(s), s.lengths, i + 1, s.q[:, i : i + 1])[:, 0]
            else:
                tok = out.ids[:, 0]  # [b] target ids
            s.draft[:, i].copy_(tok)
            h = out.hidden[:, 0]
        return out.logits if out is not None else None

    def extend(self, s, cache, v, kv_len: Live, sampled: bool = False) -> None:
        """Pairs (f_j, x_{j+1}) for the verified positions j = L..L+a -> d_hidden, d_next (the next d_1)."""
        k = v.emitted.shape[1] - 1
        steps = torch.arange(k + 1, device=v.emitted.device)
        valid = (steps[None] <= v.accepted[:, None]) & s.live[:, None]  # [b, k+1]: rejected -> the dummy slot
        a = self.head.attn_inputs(s.lengths[:, None] + steps, valid, kv_len + (k + 1))
        out = self.head(v.feats, cache, a, tokens=v.emitted, sampled=sampled)
        idx = v.accepted
        r = torch.arange(idx.shape[0], device=idx.device)
        s.own["d_hidden"].copy_(out.hidden[r, idx])
        if sampled:  # the next round's d_1, at position L + a + 2
            nxt = self._draw(out.logits, self.round_draws(s), s.lengths, 2, s.q[:, :1], idx)[:, 0]
        else:
            nxt = out.ids[r, idx]
        s.own["d_next"].copy_(nxt)

    @property
    def embed(self) -> torch.nn.Embedding:
        return self.head.embed

    # -- the state, as views -------------------------------------------------------------------------
    @property
    def hidden(self) -> Tensor:
        return self.buf["d_hidden"]

    @property
    def next(self) -> Tensor:
        return self.buf["d_next"]


def make_feature(plan, head, ctx) -> FeatureDraft:
    """`Algorithm.make` of the EAGLE-family heads: the loop reads the plan's feature kind."""
    return FeatureDraft(head, ctx.batch_size, ctx.k, plan.features)
