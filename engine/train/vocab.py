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


def build_draft_vocab(sequences: Iterable[list[int]], vocab_size: int, draft_vocab_size: int,
                      always: Iterable[int] = ()) -> tuple[Tensor, Tensor]:
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
