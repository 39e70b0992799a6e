"""The multi-layer EAGLE draft loop over `MultiLayerEagleHead` (engine/drafts/multi_layer/head.py states the
cache discipline: each module its own KV pool, a window per proposal step, a re-run per commit)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from engine.drafts.base import DeviceDraft, FeatureKind
from engine.drafts.multi_layer.head import MultiLayerEagleHead, StepCaches
from engine.graphs.runner import InputSpec
from engine.ops import Live
from engine.sampling import DRAFT, Draws, draw


class MultiLayerDraft(DeviceDraft):
    """The draft loop of `MultiLayerEagleHead` (see the module docstring for the cache discipline).

    State buffers: d_pool [b, k, H] (module i's output at its last committed position), d_next [b] (d_1),
    d_q [b, k, vocab] (a sampled round's proposal distributions: module i's draw of d_{i+1} at position
    L+i+1, the extend's (and begin's) d_1 at L'+1).
    """

    features = FeatureKind.final

    def __init__(self, head: MultiLayerEagleHead, k: int, batch_size: int):
        if k > head.num_modules:
            raise ValueError(f"k={k} drafts need {k} modules; the head has {head.num_modules}")
        super().__init__(head, batch_size, k)

    @property
    def caches(self) -> StepCaches:  # one KV pool per module
        return self.cache

    @caches.setter
    def caches(self, value: StepCaches) -> None:
        self.cache = value

    @property
    def pool(self) -> Tensor:
        """[k, b, H]: module i's output at its last committed position (a view of d_pool)."""
        return self.buf["d_pool"].transpose(0, 1)

    @property
    def next(self) -> Tensor:
        return self.buf["d_next"]

    def own_specs(self, k: int) -> dict[str, InputSpec]:
        dtype = next(self.head.parameters()).dtype
        return {
            "d_pool": InputSpec((k, self.head.args.hidden_size), dtype, None, per_row=True, state=True),
            "d_next": InputSpec((), torch.long, None, per_row=True, state=True),
        }

    def _draw(self, logits: Tensor, draws: Draws, pos: Tensor, offset: int, q: Tensor) -> Tensor:
        """[b] ids drawn from logits [b, 1, vocab] at positions pos + offset, their q written into q [b, 1, vocab]."""
        return draw(logits, draws, pos, DRAFT, kernels=self.head.fused, offset=offset, q_out=q)[:, 0]

    # -- the Draft interface ------------------------------------------------------------------------
    def prefill(
        self, caches, feats, tokens, valid, embeds, first, draws=None, q=None, kv_len=None
    ) -> dict[str, Tensor]:
        n, t = tokens.shape
        dev = tokens.device
        lens = valid.sum(1)  # [n] L
        r = torch.arange(n, device=dev)
        seq = torch.cat([tokens, tokens.new_zeros(n, self.k)], 1)  # [n, t + k]: x_0..x_L, filler
        seq[r, lens] = first
        positions = torch.arange(t, device=dev).expand(n, t)
        hidden, pool, nxt = feats, [], None
        for i in range(self.k):
            last = (lens - 1 - i).clamp(min=0)
            a = self.head.attn_inputs(positions, positions <= (lens - 1 - i)[:, None], t if kv_len is None else kv_len)
            sampled = draws is not None and i == 0  # sampled rows draw d_1 (at position L + 1)
            pick = (lambda x, last=last: x[r, last][:, None]) if i == 0 else None
            out = self.head.module_forward(i, seq[:, i + 1 : i + 1 + t], hidden, caches[i], a, pick, sampled)
            hidden = out.hidden  # [n, t, H]
            pool.append(torch.where((lens > i)[:, None], hidden[r, last], 0))  # none for a prompt of <= i tokens
            if i == 0:
                nxt = self._draw(out.logits, draws, lens, 1, q) if sampled else out.ids[:, 0]
        return {"d_pool": torch.stack(pool, 1), "d_next": nxt}  # [n, k, H], [n]

    def propose_into(self, s, caches: StepCaches, k: int, kv_len: Live, sampled: bool = False) -> Optional[Tensor]:
        """Module i = 1..k-1 over the window L-i..L-1 on d_1..d_i -> d_{i+1} at its last position."""
        s.draft[:, 0].copy_(s.own["d_next"])
        pool, window, out = s.own["d_pool"], None, None  # [b, k, H]; module i-1's window outputs
        for i in range(1, k):
            positions = (s.lengths - i)[:, None] + torch.arange(i, device=s.lengths.device)  # [b, i]
            head = pool[:, i - 1 : i]  # [b, 1, H] module i-1 at L-i
            hidden = head if i == 1 else torch.cat([head, window], 1)  # [b, i, H]
            valid = (positions >= 0) & s.live[:, None]
            a = self.head.attn_inputs(positions.clamp(min=0), valid, kv_len)
            out = self.head.module_forward(i, s.draft[:, :i], hidden, caches[i], a, lambda x: x[:, -1:], sampled)
            if sampled:  # d_{i+1} at position L+i+1
                tok = self._draw(out.logits, self.round_draws(s), s.lengths, i + 1, s.q[:, i : i + 1])
            else:
                tok = out.ids[:, -1]
            s.draft[:, i].copy_(tok)
            window = out.hidden  # [b, i, H]
        return out.logits if out is not None else None

    def extend(self, s, caches: StepCaches, v, kv_len: Live, sampled: bool = False) -> None:
        """Module i re-runs positions L-i..L-i+k on the emitted tokens, rows valid up to index a."""
        k = v.emitted.shape[1] - 1
        steps = torch.arange(k + 1, device=v.emitted.device)
        idx = v.accepted
        r = torch.arange(idx.shape[0], device=idx.device)
        outs = []
        for i in range(k):
            positions = (s.lengths - i)[:, None] + steps  # [b, k+1]: L-i..L-i+k
            if i == 0:
                hidden = v.feats  # the target's final hidden states at L..L+k
            else:  # module i-1 at L-i (before this commit), then its commit outputs at L-i+1..
                hidden = torch.cat([s.own["d_pool"][:, i - 1 : i], outs[i - 1].hidden[:, :k]], 1)
            valid = (steps[None] <= v.accepted[:, None]) & s.live[:, None] & (positions >= 0)
            a = self.head.attn_inputs(positions.clamp(min=0), valid, kv_len + (k + 1))
            pick = (lambda x: x[r, idx][:, None]) if i == 0 else None
            outs.append(self.head.module_forward(i, v.emitted, hidden, caches[i], a, pick, sampled and i == 0))
        s.own["d_pool"][:, :k].copy_(torch.stack([out.hidden[r, idx] for out in outs], 1))
        if sampled:  # the next round's d_1, at position L + a + 2
            nxt = self._draw(outs[0].logits, self.round_draws(s), s.lengths + idx, 2, s.q[:, :1])
        else:
            nxt = outs[0].ids[:, 0]
        s.own["d_next"].copy_(nxt)


def make_multi_layer(plan, head, ctx) -> MultiLayerDraft:
    return MultiLayerDraft(head, ctx.k, ctx.batch_size)
