"""The reduced draft vocabulary of an EAGLE3 head: the most frequent target tokens of the training data.

    d2t [draft_vocab] int64   target id = draft id + d2t[draft id]   (the public EAGLE3 format)
    t2d [vocab] bool          which target ids the draft can propose

Draft ids follow ascending target id, as SpecForge writes them.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch
from torch import Tensor


def build_draft_vocab(
    sequences: Iterable[list[int]], vocab_size: int, draft_vocab_size: int, always: Iterable[int] = ()
) -> tuple[Tensor, Tensor]:
    """Top `draft_vocab_size` tokens by count (ties: lower id first); `always` (e.g. EOS) are kept in."""
    counts = Counter(t for seq in sequences for t in seq)
    keep = list(dict.fromkeys(always))
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    keep += [t for t in ranked if t not in keep][: draft_vocab_size - len(keep)]
    keep += [t for t in range(vocab_size) if t not in set(keep)][: draft_vocab_size - len(keep)]  # pad if rare
    used = torch.tensor(sorted(keep), dtype=torch.long)  # [draft_vocab]
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def fit_draft_vocab(head, sequences: Iterable[list[int]], always: Iterable[int] = ()) -> None:
    """Set a head's d2t/t2d from the most frequent tokens of `sequences` (`build_draft_vocab` at the
    head's draft_vocab_size); heads over the target's vocabulary (shares_lm_head) have none to set."""
    if head.shares_lm_head:
        return
    d2t, t2d = build_draft_vocab(sequences, head.args.vocab_size, head.draft_vocab_size, always)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
