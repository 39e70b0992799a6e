"""`FeatureDraft`: the draft loop shared by the EAGLE-family heads (EAGLE3, EAGLE).

State per row, after `begin` or `commit`: the draft has processed positions 0..L-1 (L = tokens in the
target cache), and holds `hidden` (its output at L-1) and `next` (its first proposal, d_1).

    begin    pairs (f_j, x_{j+1}) for prompt positions j = 0..L-1 (x_L: the target's first token);
             reuses the target's input embeddings for prompt positions when the prompt came as embeds
    propose  d_1 = next; step i = 1..k-1 at position L+i-1 on (h, d_i) -> d_{i+1}
    commit   pairs (f_j, x_{j+1}) for the verified positions j = L..L+a (x: accepted tokens, then
             the bonus); overwrites the draft cache where the proposal steps wrote
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from engine.drafts.base import Draft, FeatureKind, Proposal, SpecState, cache_and_runners, put_rows
from engine.graphs.runner import CaptureHiddenMode
from engine.model import run_steps
from engine.sampling import SamplingParams, draft_draw


class FeatureDraft(Draft):
    def __init__(self, head, batch_size: int, params: SamplingParams, generator: Optional[torch.Generator],
                 features: FeatureKind, graphs=None):
        self.head, self.params, self.generator, self.batch_size = head, params, generator, batch_size
        self.features = features
        self.cache, (self.step_runner, self.extend_runner) = cache_and_runners(
            head, batch_size, graphs, ["draft_step", "draft_extend"])
        self.hidden: Optional[Tensor] = None  # [b, hidden]
        self.next: Optional[Tensor] = None  # [b] target ids
        self.next_probs: Optional[Tensor] = None  # [b, vocab] or None (greedy)

    @property
    def embed(self) -> torch.nn.Embedding:
        return self.head.embed

    def _forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, valid: Optional[Tensor], kv_len: int,
                 embeds: Optional[Tensor] = None, runner=None, rows: Optional[slice] = None) -> tuple[Tensor, Tensor]:
        """-> out_hidden [b, t, hidden], logits [b, t, draft vocab]; through `runner` when given (the
        whole batch), else eagerly over the cache rows `rows` (default: the first b)."""
        env = {"tokens": tokens, "hidden": hidden, "positions": positions, "valid": valid, "kv_len": kv_len,
               "input_embeds": embeds}
        if runner is not None and embeds is None:
            b, t = tokens.shape
            env["valid"] = valid.expand(b, t) if valid is not None else torch.ones_like(tokens, dtype=torch.bool)
            out, _ = runner(env, kv_len, CaptureHiddenMode.FULL if t > 1 else CaptureHiddenMode.LAST)
            return out["out_hidden"], out["logits"]
        cache = self.cache.rows(rows if rows is not None else tokens.shape[0])
        run_steps(self.head.program(cache, embeds_input=embeds is not None), env)
        return env["out_hidden"], env["logits"]

    def _pick(self, logits: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """logits [b, draft_vocab] -> target token ids [b], target-vocab probs [b, vocab] (sampling only)."""
        ids, q = draft_draw(logits, self.params, self.generator)
        return self.head.to_target(ids), None if q is None else self.head.probs_to_target(q)

    def _take(self, h: Tensor, logits: Tensor, idx: Tensor, rows: Optional[slice] = None) -> None:
        """Carry each row's hidden state and next proposal from index idx [b] of a forward's outputs;
        with `rows`, into those rows of the batch's state (the rest keep theirs)."""
        r = torch.arange(h.shape[0], device=h.device)
        hidden = h[r, idx]  # [b, hidden]
        nxt, probs = self._pick(logits[r, idx])
        n = self.batch_size
        self.hidden = put_rows(self.hidden, hidden, rows, n)
        self.next, self.next_probs = put_rows(self.next, nxt, rows, n), put_rows(self.next_probs, probs, rows, n)

    def begin(self, state, feats, prompt_tokens, valid, input_embeds, first, rows=None) -> None:
        b, t = prompt_tokens.shape
        last = valid.sum(1) - 1  # [b] index of each prompt's last token
        r = torch.arange(b, device=first.device)
        shifted = torch.cat([prompt_tokens[:, 1:], prompt_tokens[:, :1]], 1)  # x_{j+1}; last column is filler
        shifted[r, last] = first
        embeds = None
        if input_embeds is not None:  # the multimodal path: reuse the target's embeddings
            embeds = torch.cat([input_embeds[:, 1:], input_embeds[:, :1]], 1).clone()
            embeds[r, last] = self.embed(first)
        positions = torch.arange(t, device=first.device).expand(b, t)
        h, logits = self._forward(shifted, feats, positions, valid, t, embeds, rows=rows)
        self._take(h, logits, last, rows)

    def propose(self, state: SpecState, k: int) -> Proposal:
        lengths, live = state.on_device()
        live = live[:, None]
        tokens, probs = [self.next], [self.next_probs]
        h, tok = self.hidden, self.next
        for i in range(1, k):
            h_all, logits = self._forward(tok[:, None], h[:, None], (lengths + i - 1)[:, None], live,
                                          max(state.lengths) + i, runner=self.step_runner)
            h = h_all[:, 0]
            tok, p = self._pick(logits[:, 0])
            tokens.append(tok)
            probs.append(p)
        return Proposal(torch.stack(tokens, 1), None if self.params.greedy else torch.stack(probs, 1))

    def commit(self, state, feats, emitted, accepted) -> None:
        b, width = emitted.shape
        dev = emitted.device
        steps = torch.arange(width, device=dev)
        lengths, live = state.on_device()
        valid = (steps[None] <= accepted[:, None]) & live[:, None]
        positions = lengths[:, None] + steps[None]  # L..L+k
        h, logits = self._forward(emitted, feats, positions, valid, max(state.lengths) + width,
                                  runner=self.extend_runner)
        self._take(h, logits, accepted)
