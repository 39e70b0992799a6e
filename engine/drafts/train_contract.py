"""The contract between a draft's training forward and the shared trainer: the batch, what a forward
returns, the shared loss, and the record (`TrainSpec`) each algorithm's folder exports.

A chain anchored at position j (the target holds positions 0..j) drafts step s = 0, 1, ... at position
p = j + s; every step at p reads the token x_{p+1} and predicts x_{p+2}. A forward returns per-step logits
aligned by p, so tokens and labels are the same for every step:

    batch.tokens   [B, T]          x_{p+1}, the token the draft reads at position p
    batch.feats    [B, T, F]       target features at p (aux: F = n_aux * target hidden; final: hidden)
    batch.label_logits [B, T, Vd]  the target's logits z_{p+1} over the draft vocabulary (its dtype); the
                                   head learns softmax(z / label_temperature) (batch.labels: that, fp32)
    batch.top      [B, T]          draft id of x_{p+2}, the sample's next token: on the target's own greedy
                                   answers, its greedy token (-1: outside the draft vocab)
    batch.mask     [B, T] bool     positions trained on (the answer part of a sample)
    batch.spans    [B, 2] int64    on the host: each row's trained positions [first, end), where mask is
                                   True (a forward that skips untrained positions plans on it, no sync)
    step logits    [B, T, Vd]      one tensor per step: logits[s][:, p] from the chain anchored at p - s;
                   or `Rows`       at the step's trained positions only (a forward that computes no others):
                                   the lm_head's input [M, H], its frozen weight and the flat positions
                                   b * T + p; the loss applies the lm_head fused with the cross-entropy

Loss: cross-entropy against the target distribution (forward KL up to a constant), step s weighted
by `decay ** s`, as EAGLE-3 does; `kernels/soft_ce.py` computes it per position from the label logits
(kernel "triton": fused, without the fp32 [B, T, Vd] tensors of the plain-torch path; for `Rows`
`linear_soft_cross_entropy`, whose forward also forms the gradient: the logits never stored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.drafts.base import FeatureKind
from kernels.soft_ce import linear_soft_cross_entropy, soft_cross_entropy


@dataclass
class Batch:
    tokens: Tensor  # [B, T] int64
    positions: Tensor  # [B, T] int64
    feats: Tensor  # [B, T, F]
    label_logits: Tensor  # [B, T, Vd] the target's logits over the draft vocabulary
    top: Tensor  # [B, T] int64
    mask: Tensor  # [B, T] bool
    label_temperature: float = 1.0  # labels = softmax(label_logits / T)
    spans: Optional[Tensor] = None  # [B, 2] int64 on the host: [first, end) of the trained positions

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def labels(self) -> Tensor:  # [B, T, Vd] float32: the distribution the head learns
        return (self.label_logits.float() / self.label_temperature).softmax(-1)


@dataclass
class Rows:
    """One step's lm_head input at its trained positions only (those of `step_valid`, each once, in any
    order): the loss forms the logits, fused with the cross-entropy (never stored)."""

    hidden: Tensor  # [M, H] the final norm's output
    weight: Tensor  # [Vd, H] the lm_head's weight, frozen
    position: Tensor  # [M] int64: flat index b * T + p into the batch's [B, T]

    @property
    def logits(self) -> Tensor:  # [M, Vd], formed on demand (a check's; the loss never stores them)
        return F.linear(self.hidden.to(self.weight.dtype), self.weight)


def shift(x: Tensor, n: int, dim: int) -> Tensor:
    """Shift right by n along dim, zero-filled: out[..., p, ...] = x[..., p - n, ...]."""
    if n == 0:
        return x
    t = x.shape[dim]
    pad = x.new_zeros(*x.shape[:dim], min(n, t), *x.shape[dim + 1 :])
    return torch.cat([pad, x.narrow(dim, 0, t - min(n, t))], dim)


def shift_left(x: Tensor, n: int) -> Tensor:
    """out[:, p] = x[:, p + n] along dim 1, zero-filled at the end (position-indexed step n -> by anchor)."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], x.new_zeros(x.shape[0], min(n, x.shape[1]), *x.shape[2:])], 1)


def step_valid(mask: Tensor, s: int) -> Tensor:
    """Positions where step s has a full chain behind it (anchor p - s >= 0) and is trained on."""
    return mask & (torch.arange(mask.shape[1], device=mask.device) >= s)[None]


def ttt_loss(
    logits: list[Tensor | Rows], batch: Batch, decay: float = 0.8, kernel: str = "torch"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Cross-entropy against the target distribution, step s weighted decay ** s; also per-step loss and
    greedy accuracy (0-d tensors: reading them is a device sync, left to the caller). Only the valid
    positions are computed; `kernel` is soft_cross_entropy's (torch or triton). A step's logits are
    [B, T, Vd], or `Rows` (its valid positions only, through the lm_head fused with the loss, scored
    against their target rows in place)."""
    total, stats = batch.label_logits.new_zeros((), dtype=torch.float32), {}
    norm = sum(decay**s for s in range(len(logits)))
    target = batch.label_logits.flatten(0, 1)  # [B*T, Vd]
    probs = batch.labels.flatten(0, 1) if kernel == "torch" else None  # the torch path's labels, once a batch
    top_at = batch.top.flatten()  # [B*T]
    for s, lg in enumerate(logits):
        weight = decay**s / norm
        if isinstance(lg, Rows):  # [M, H] at the step's M valid positions: the fused lm_head and loss
            n = max(lg.position.numel(), 1)
            part, ce, top = linear_soft_cross_entropy(
                lg.hidden, lg.weight, target, batch.label_temperature, lg.position, weight / n, kernel, probs
            )
            total = total + part
            stats[f"loss_{s}"] = ce.sum() / n
            stats[f"acc_{s}"] = (top == top_at[lg.position]).sum() / n
            continue
        valid = step_valid(batch.mask, s)  # [B, T] by position p = j + s
        n = valid.sum().clamp(min=1)
        ce, top = soft_cross_entropy(lg.flatten(0, 1), target, batch.label_temperature, valid.flatten(), kernel, probs)
        loss_s = (ce.view_as(valid) * valid).sum() / n
        right = ((top.view_as(valid) == batch.top) & valid).sum()  # [B, T] by position
        total = total + weight * loss_s
        stats[f"loss_{s}"] = loss_s.detach()
        stats[f"acc_{s}"] = right / n
    return total, stats


@dataclass(frozen=True)
class TrainSpec:
    """How one draft algorithm trains on the shared self-distilled data (its folder's `Algorithm.train`).

    features    what `target_batch` puts in Batch.feats (aux layers, or the final hidden state)
    forward     (head, batch, steps) -> per-step logits [B, T, V], aligned so that logits[s][:, p]
                predicts label index p (the target's distribution of x_{p+2}) for the chain anchored
                at j = p - s: step s of a proposal made when the target holds positions 0..j
    packed_forward  the training step's forward under train.attention=flex where it differs: the same
                logits at each step's trained positions only (`Rows`), without computing the others
    loss        (logits, batch, decay, kernel=...) -> (loss, stats); acceptance is read from the logits' greedy chains
                (chain_lengths), the same for every draft
    check       (cfg, draft_plan) -> None, raising a ConfigError: the stage's plan-time check of what
                only this algorithm constrains (e.g. DFlash: train.ttt_steps within the block)
    prepare     (student, sequences, always) -> None: fit what the training data decides before training
                (EAGLE3: the reduced draft vocabulary from the most frequent tokens; `always`: EOS ids)
    summary, objective  the model card's words for the head and its training: templates over the card's
                fields (engine/train/card.py: training.json, config.json, the stored tensors)
    """

    features: FeatureKind
    forward: Callable
    flex_attention: Optional[Callable] = None  # train.attention=flex: forward(..., attention=this)
    forward_ops: bool = False  # forward(..., ops=TRITON_OPS) exists (train.kernels=triton)
    packed_forward: Optional[Callable] = None  # train.attention=flex: (head, batch, steps[, ops]) -> [Rows]
    loss: Callable = ttt_loss
    check: Optional[Callable] = None
    prepare: Optional[Callable] = None
    summary: str = "A `{architecture}` draft head."
    objective: str = "Training-time test with {train[ttt_steps]} unrolled steps"

    @property
    def flex(self) -> bool:
        """It trains with FlexAttention (train.attention=flex): through `flex_attention` or `packed_forward`."""
        return self.flex_attention is not None or self.packed_forward is not None
