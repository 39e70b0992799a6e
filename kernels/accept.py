"""A round's bookkeeping on the device in one launch each: greedy acceptance, then the state's advance.

    accept_greedy(target, draft, out, speculate=None) -> (accepted, bonus)
        target [b, k+1] int64   the target's argmax at each verified position
        draft  [b, k]   int64   the draft tokens (any row stride)
        out    [b, k+2] int64   written: [a, d_1..d_a, bonus, d_{a+2}..d_k, bonus]: a = the number of
                                leading draft tokens equal to the target's, the bonus = target[a]
        speculate [b] bool      False: a = 0 (the row opted out: its bonus is a plain decode step's)
        accepted [b] = out[:, 0] (a view), bonus [b]
    advance(lengths, last, live, accepted, bonus)
        lengths += a + 1 and last = bonus, for live rows only (in place)

One program per row. The plain-torch definitions (`accept_greedy_reference`, `advance_reference`)
are what the kernels are tested against (TRITON_INTERPRET=1 on CPU, and on the GPU); they cost ten
and four small launches.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kernels.runtime import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _accept_kernel(
        TARGET, s_t, DRAFT, s_d, OUT, s_o, BONUS, SPEC, K: tl.constexpr, KP: tl.constexpr, HAS_SPEC: tl.constexpr
    ):
        row = tl.program_id(0)
        i = tl.arange(0, KP)  # [KP] positions 0..k (padded)
        t = tl.load(TARGET + row * s_t + i, mask=i <= K, other=-1)
        d = tl.load(DRAFT + row * s_d + i, mask=i < K, other=-2)
        a = tl.min(tl.where((d != t) | (i >= K), i, K), 0)  # the first mismatch; k when all match
        if HAS_SPEC:  # an opted-out row accepts nothing
            a = tl.where(tl.load(SPEC + row) != 0, a, 0)
        bonus = tl.sum(tl.where(i == a, t, 0), 0)
        # emitted: the drafts, the bonus at a and at k (past a the tokens are never read as output, but a
        # draft extend embeds them: they must be real ids, as the reference's)
        tl.store(OUT + row * s_o + 1 + i, tl.where((i == a) | (i == K), bonus, d), mask=i <= K)
        tl.store(OUT + row * s_o, a.to(tl.int64))
        tl.store(BONUS + row, bonus)

    @triton.jit
    def _advance_kernel(LENGTHS, LAST, LIVE, ACCEPTED, s_a, BONUS, B, BLOCK: tl.constexpr):
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = r < B
        live = tl.load(LIVE + r, mask=m, other=0) != 0
        a = tl.load(ACCEPTED + r * s_a, mask=m, other=0)
        n = tl.load(LENGTHS + r, mask=m, other=0)
        tl.store(LENGTHS + r, tl.where(live, n + a + 1, n), mask=m)
        last = tl.load(LAST + r, mask=m, other=0)
        tl.store(LAST + r, tl.where(live, tl.load(BONUS + r, mask=m, other=0), last), mask=m)


def accept_greedy_reference(target: Tensor, draft: Tensor, speculate: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """target [b, k+1]: the target's argmax at each verified position; draft [b, k] -> (a [b], bonus [b]):
    the longest prefix of the draft the target agrees with (none where speculate is False), and the
    target's token after it."""
    if draft.shape[1] == 0:  # plain decoding: the argmax, nothing to accept (fewer launches per step)
        bonus = target[:, 0]  # [b]
        return torch.zeros_like(bonus), bonus
    accepted = (draft == target[:, :-1]).int().cumprod(1).sum(1)  # [b]
    if speculate is not None:
        accepted = accepted * speculate
    return accepted, target.gather(1, accepted[:, None])[:, 0]


def accept_greedy(
    target: Tensor, draft: Tensor, out: Tensor, speculate: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """See the module docstring; -> (accepted [b] (a view of out), bonus [b])."""
    b, k1 = target.shape
    k = k1 - 1
    assert draft.shape == (b, k) and out.shape[0] == b and out.shape[1] >= k + 2
    if triton is None:
        accepted, bonus = accept_greedy_reference(target, draft, speculate)
        write_out_reference(draft, accepted, bonus, out)
        return out[:, 0], bonus
    bonus = torch.empty(b, dtype=torch.long, device=target.device)
    target = target.contiguous()
    _accept_kernel[(b,)](
        target,
        target.stride(0),
        draft,
        draft.stride(0),
        out,
        out.stride(0),
        bonus,
        speculate.view(torch.uint8) if speculate is not None else bonus,
        K=k,
        KP=triton.next_power_of_2(k + 1),
        HAS_SPEC=speculate is not None,
        num_warps=1,
    )
    return out[:, 0], bonus


def write_out_reference(draft: Tensor, accepted: Tensor, bonus: Tensor, out: Tensor) -> None:
    """out [b, k+2] = [a, d_1..d_k with the bonus at a, the bonus]: the row `_accept_kernel` writes,
    from an acceptance decided elsewhere (plain torch, kernels/sample.py's reference)."""
    k = draft.shape[1]
    emitted = torch.cat([draft, bonus[:, None]], 1)  # [b, k+1]: d_1..d_k, bonus
    emitted[torch.arange(draft.shape[0], device=draft.device), accepted] = bonus
    out[:, :1].copy_(accepted[:, None])
    out[:, 1 : k + 2].copy_(emitted)


def advance_reference(lengths: Tensor, last: Tensor, live: Tensor, accepted: Tensor, bonus: Tensor) -> None:
    lengths.add_((accepted + 1) * live)
    last.copy_(torch.where(live, bonus, last))


def advance(lengths: Tensor, last: Tensor, live: Tensor, accepted: Tensor, bonus: Tensor) -> None:
    if triton is None:
        return advance_reference(lengths, last, live, accepted, bonus)
    b = lengths.shape[0]
    assert lengths.is_contiguous() and last.is_contiguous() and live.is_contiguous()
    block = min(1024, triton.next_power_of_2(b))
    _advance_kernel[(triton.cdiv(b, block),)](
        lengths, last, live.view(torch.uint8), accepted, accepted.stride(0), bonus, b, BLOCK=block, num_warps=1
    )
