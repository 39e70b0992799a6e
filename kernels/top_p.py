"""Nucleus (top-p) filtering without a sort: each row's probability threshold, found by search.

    top_p_threshold(probs, top_p) -> tau [N] fp32
        probs   [N, V] fp32 probabilities (rows sum to 1)
        top_p   a float, or [N] / [N, 1] per row
        tau     the largest float t with sum(p_v for p_v >= t) >= top_p (0 where even the whole row falls
                short, and where top_p >= 1): the nucleus is {v: p_v >= tau}, the smallest set of the most
                likely tokens whose mass reaches top_p, the token that reaches it included (ties at tau all
                kept); top_p >= 1 keeps every token whatever the rounding of the row's sum

The sort-based filter (`top_p_filter_reference`: sort, cumsum, scatter back) costs a segmented radix sort
of every row: at the self-distillation's 1024 rows of 49152 it and its scatter took about 7 ms a sampled
step on an H100, more than the step's attention.
Here one program searches a row's threshold over the bit patterns of non-negative floats (ordered like
the floats): each pass reads the row once and sums the mass at or above 8 candidate thresholds, cutting
the interval ninefold, so about 10 passes pin the exact float. The mass function is monotone, so the
search returns the same set as the sort wherever no two partial sums straddle top_p by float rounding.
The search (`_search`) also runs on logits directly: kernels/sample.py searches each row's unnormalised
weights exp((z - max z) / T) against top_p times their sum, so no probability row is ever written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.runtime import triton

if triton is not None:
    import triton.language as tl

_BLOCK = 1024  # columns a program reads at once
_CANDIDATES = 8  # thresholds tried per pass over a row


def top_p_filter_reference(probs: Tensor, top_p: float | Tensor) -> Tensor:
    """probs [N, V] with the tokens outside each row's nucleus zeroed (not renormalized): the sort path."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p >= top_p) & (top_p < 1)  # the mass before a token reaches top_p
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))


if triton is not None:

    @triton.jit
    def _mass_at(ROW, n_cols, taus, zmax, inv_t, FROM_LOGITS: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
        """[K] the row's mass at or above each threshold in taus: of its probabilities, or (FROM_LOGITS) of
        its weights w = exp((z - zmax) * inv_t) read from logits z."""
        mass = tl.zeros((K,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            if FROM_LOGITS:
                z = tl.load(ROW + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
                x = tl.exp((z - zmax) * inv_t)
            else:
                x = tl.load(ROW + cols, mask=cols < n_cols, other=0.0)
            mass += tl.sum(tl.where(x[:, None] >= taus[None, :], x[:, None], 0.0), 0)
        return mass

    @triton.jit
    def _search(
        ROW, n_cols, hi, target, lo_mass, zmax, inv_t, FROM_LOGITS: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr
    ):
        """(lo, the mass at lo): lo the largest bit pattern of a non-negative fp32 threshold whose mass reaches
        `target`, searched in [0, hi) (hi: just above the largest value; 1: no search, lo = 0 with lo_mass).
        Invariant: mass(lo) >= target (but for lo = 0 when the row's mass falls short) and mass(hi) < target,
        over the int64 bit patterns of non-negative fp32 (ordered as the floats are)."""
        lo = tl.zeros((), dtype=tl.int64)
        hi = lo + hi  # loop-carried int64 / fp32 scalars whatever the caller passed
        lo_mass = tl.zeros((), dtype=tl.float32) + lo_mass
        k = tl.arange(0, K)
        while hi - lo > 1:
            mids = lo + (hi - lo) * (k + 1) // (K + 1)  # [K] ascending candidates in (lo, hi)
            taus = mids.to(tl.int32).to(tl.float32, bitcast=True)
            mass = _mass_at(ROW, n_cols, taus, zmax, inv_t, FROM_LOGITS, K, BLOCK)
            ok = tl.sum((mass >= target).to(tl.int32), 0)  # mass falls with the threshold: a prefix reaches it
            lo_mass = tl.where(ok > 0, tl.sum(tl.where(k == ok - 1, mass, 0.0), 0), lo_mass)
            lo = tl.where(ok > 0, tl.sum(tl.where(k == ok - 1, mids, 0), 0), lo)
            hi = tl.where(ok < K, tl.sum(tl.where(k == ok, mids, 0), 0), hi)
        return lo, lo_mass

    @triton.jit
    def _top_p_threshold_kernel(
        P, TOP_P, OUT, n_cols, top_p, PER_ROW: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        p_row = P + row * n_cols
        if PER_ROW:
            top_p = tl.load(TOP_P + row)
        top = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            top = tl.maximum(top, tl.max(tl.load(p_row + cols, mask=cols < n_cols, other=0.0), 0))
        hi = top.to(tl.int32, bitcast=True).to(tl.int64) + 1  # just above the largest probability: no mass
        hi = tl.where(top_p < 1.0, hi, 1)  # top_p >= 1 keeps every token, whatever the sum's rounding
        lo, _ = _search(p_row, n_cols, hi, top_p, 1.0, 0.0, 1.0, False, K, BLOCK)
        tl.store(OUT + row, lo.to(tl.int32).to(tl.float32, bitcast=True))


def top_p_threshold(probs: Tensor, top_p: float | Tensor) -> Tensor:
    """tau [N] fp32 for probs [N, V] fp32 (module doc); top_p a float or [N] / [N, 1]."""
    if triton is None:
        raise RuntimeError("top_p_threshold needs triton (top_p_filter_reference is the plain-torch path)")
    if probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError(f"top_p_threshold: probs {tuple(probs.shape)} {probs.dtype}; valid: [N, V] float32")
    n, v = probs.shape
    out = torch.empty(n, dtype=torch.float32, device=probs.device)
    per_row = isinstance(top_p, Tensor)
    rows = top_p.reshape(n).float().contiguous() if per_row else out
    if n:
        _top_p_threshold_kernel[(n,)](
            probs.contiguous(), rows, out, v, 0.0 if per_row else float(top_p),
            PER_ROW=per_row, K=_CANDIDATES, BLOCK=_BLOCK,
        )  # fmt: skip
    return out


def top_p_filter(probs: Tensor, top_p: float | Tensor) -> Tensor:
    """probs [..., V] fp32 with the tokens outside each row's nucleus zeroed (not renormalized): the search
    kernel on CUDA, the sort elsewhere (and without triton)."""
    if triton is None or not probs.is_cuda:
        return top_p_filter_reference(probs, top_p)
    flat = probs.reshape(-1, probs.shape[-1])  # [N, V]
    tau = top_p_threshold(flat, top_p)
    return flat.masked_fill(flat < tau[:, None], 0.0).view(probs.shape)
