"""Weightless drafts that read the token history on the host: n-gram prompt lookup, and the oracle.

ngram   the longest suffix (ngram_max down to ngram_min tokens) of the history that occurred
        earlier in it; propose the k tokens that followed that earlier occurrence (the most
        recent one). No match: propose the last token repeated (verify rejects it cheaply).
oracle  proposes the target's own greedy continuation, read from a reference run (the no-draft
        baseline of the same job): full acceptance, so its speedup is the ceiling of the
        draft-and-verify loop with k draft tokens. Timing and tests only.
"""

from __future__ import annotations

import torch

from engine.drafts.base import Draft, Proposal, SpecState


def ngram_lookup(history: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """k tokens following the latest earlier occurrence of the longest matching suffix."""
    size = len(history)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = history[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest occurrence first, not the suffix itself
            if history[start : start + n] == suffix:
                follow = history[start + n : start + n + k]
                return follow + [follow[-1]] * (k - len(follow))
    return [history[-1]] * k


class NgramDraft(Draft):
    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, state: SpecState, k: int) -> Proposal:
        rows = [ngram_lookup(h, k, self.n_max, self.n_min) for h in state.history]
        return Proposal(torch.tensor(rows, device=state.device))


class OracleDraft(Draft):
    def __init__(self, references: list[list[int]], prompt_lens: list[int]):
        self.references = references  # per prompt of the whole set: the target's greedy output
        self.prompt_lens = prompt_lens

    def propose(self, state: SpecState, k: int) -> Proposal:
        rows = []
        for r, hist in zip(state.row_ids, state.history):
            ref, done = self.references[r], len(hist) - self.prompt_lens[r]  # tokens emitted so far
            follow = ref[done : done + k]
            rows.append(follow + [hist[-1]] * (k - len(follow)))
        return Proposal(torch.tensor(rows, device=state.device))
