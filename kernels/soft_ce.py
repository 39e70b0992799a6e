"""Cross-entropy against a soft target given by its logits, fused: the draft-training loss.

    soft_cross_entropy(logits, target_logits, temperature, rows=None, kernel="torch", probs=None)
        -> (ce, argmax)
        logits          [N, V]  the head's logits (any float dtype; bf16 under autocast), differentiable
        target_logits   [N, V]  the target's logits over the same vocabulary; labels p = softmax(t / T)
        rows            [N] bool, optional: the rows to compute (the others: ce 0, argmax -1, gradient 0)
        probs           [N, V] fp32, optional: p itself, for the torch path when a caller reuses one target
                        over several calls (ttt_loss's steps); the Triton path never materializes it
        ce              [N] fp32   -sum_v p_v log softmax(logits)_v  =  lse(logits) - sum_v p_v logits_v
        argmax          [N] int64  the logits' argmax (first index of the maximum), for accuracy figures

The plain-torch path materializes p, log_softmax(logits) in fp32 and their product, and autograd keeps
them for the backward: about ten passes over an [N, V] fp32 tensor per call. The Triton path reads
logits and target_logits once in the forward (one program per row, an online logsumexp of both and the
p-weighted sum, the argmax on the way) and once in the backward, which writes the gradient
softmax(logits) - p scaled by the incoming grad, straight in logits' dtype; it keeps only the two
logsumexps per row ([N] fp32 each). Math in fp32 on both paths.

    linear_soft_cross_entropy(hidden, weight, target_logits, temperature, index, scale, kernel="torch", probs=None)
        -> (loss, ce, argmax)
        hidden [M, H], weight [V, H] (a frozen lm_head): the logits hidden @ weight.T scored as above, row i
        against target row index[i] (target_logits and probs [R, V]: a head that forms its logits at some
        positions only; the Triton path reads them in place, never gathered); loss = scale * sum(ce),
        differentiable in hidden only; ce [M] and argmax [M] detached. The Triton path computes the
        gradient in its forward: one kernel reads each row twice (logsumexps, then softmax(z) - p written
        over the logits in place), and hidden's gradient (softmax(z) - p) @ weight is formed there, so the
        [M, V] logits die inside the call and the backward only scales an [M, H] tensor (the incoming grad
        is a scalar): no backward pass over [M, V].

`soft_cross_entropy_reference` is the plain-torch definition; the Triton kernels are tested against it
(TRITON_INTERPRET=1 on CPU, and on the GPU).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kernels.runtime import triton

if triton is not None:
    import triton.language as tl

SOFT_CE_KERNELS = ("torch", "triton")
_BLOCK = 1024  # columns a program reads at once (the draft vocabularies here: 8192..49152)


def soft_cross_entropy_reference(
    logits: Tensor,
    target_logits: Tensor,
    temperature: float,
    rows: Optional[Tensor] = None,
    probs: Optional[Tensor] = None,
    index: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    if index is not None:
        target_logits = target_logits[index]
        probs = probs[index] if probs is not None else None
    p = (target_logits.float() / temperature).softmax(-1) if probs is None else probs  # [N, V]
    ce = -(p * torch.log_softmax(logits.float(), -1)).sum(-1)  # [N]
    arg = logits.argmax(-1)
    if rows is None:
        return ce, arg
    return torch.where(rows, ce, torch.zeros_like(ce)), torch.where(rows, arg, torch.full_like(arg, -1))


if triton is not None:

    @triton.jit
    def _soft_ce_fwd_kernel(
        Z,
        T,
        ROWS,
        IDX,
        CE,
        LSE_Z,
        LSE_T,
        ARG,
        n_cols,
        inv_temp,
        grad_scale,
        HAS_ROWS: tl.constexpr,
        HAS_IDX: tl.constexpr,
        GRAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        n = n_cols
        if HAS_ROWS:
            n = tl.where(tl.load(ROWS + row) != 0, n_cols, 0)  # a dead row runs no iteration
        t_at = tl.load(IDX + row).to(tl.int64) if HAS_IDX else row  # the target row scored against
        z_row, t_row = Z + row * n_cols, T + t_at * n_cols
        m_z, s_z = float("-inf"), 0.0  # running max and sum of exp(z - m_z)
        m_t, s_t, a = float("-inf"), 0.0, 0.0  # the same for t / T, and sum of exp(t / T - m_t) * z
        best, best_i = float("-inf"), 0
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < n_cols
            z = tl.load(z_row + cols, mask=m, other=float("-inf")).to(tl.float32)
            t = tl.load(t_row + cols, mask=m, other=float("-inf")).to(tl.float32) * inv_temp
            bm = tl.max(z, 0)
            bi = tl.argmax(z, 0)
            best_i = tl.where(bm > best, start + bi, best_i)  # strictly greater: the first maximum wins
            best = tl.maximum(best, bm)
            new_z = tl.maximum(m_z, bm)
            s_z = s_z * tl.exp(m_z - new_z) + tl.sum(tl.exp(z - new_z), 0)
            m_z = new_z
            new_t = tl.maximum(m_t, tl.max(t, 0))
            scale = tl.exp(m_t - new_t)
            e = tl.exp(t - new_t)  # 0 on masked columns
            s_t = s_t * scale + tl.sum(e, 0)
            a = a * scale + tl.sum(e * tl.where(m, z, 0.0), 0)
            m_t = new_t
        live = n > 0  # a dead row's sums stay 0: made harmless before the logs and the division
        s_z, s_t = tl.where(live, s_z, 1.0), tl.where(live, s_t, 1.0)
        lse_z = tl.where(live, m_z, 0.0) + tl.log(s_z)
        tl.store(CE + row, tl.where(live, lse_z - a / s_t, 0.0))
        tl.store(LSE_Z + row, lse_z)
        lse_t = tl.where(live, m_t, 0.0) + tl.log(s_t)
        tl.store(LSE_T + row, lse_t)
        tl.store(ARG + row, tl.where(live, best_i, -1).to(tl.int64))
        if GRAD:  # every row live: grad_scale * (softmax(z) - p) over z in place, the row read a second time
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                m = cols < n_cols
                z = tl.load(z_row + cols, mask=m, other=0.0).to(tl.float32)
                t = tl.load(t_row + cols, mask=m, other=0.0).to(tl.float32) * inv_temp
                dz = grad_scale * (tl.exp(z - lse_z) - tl.exp(t - lse_t))
                tl.store(z_row + cols, dz.to(Z.dtype.element_ty), mask=m)

    @triton.jit
    def _soft_ce_bwd_kernel(
        Z,
        T,
        ROWS,
        LSE_Z,
        LSE_T,
        G,
        DZ,
        n_cols,
        inv_temp,
        HAS_ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        m = cols < n_cols
        n = n_cols
        if HAS_ROWS:  # a dead row reads nothing and writes 0 (its lse are 0, not its own: exp(t / T) of its
            n = tl.where(tl.load(ROWS + row) != 0, n_cols, 0)  # real logits may overflow, 0 * inf is NaN)
        m_in = cols < n
        g = tl.load(G + row)
        z = tl.load(Z + row * n_cols + cols, mask=m_in, other=0.0).to(tl.float32)
        t = tl.load(T + row * n_cols + cols, mask=m_in, other=0.0).to(tl.float32) * inv_temp
        dz = tl.where(m_in, g * (tl.exp(z - tl.load(LSE_Z + row)) - tl.exp(t - tl.load(LSE_T + row))), 0.0)
        tl.store(DZ + row * n_cols + cols, dz.to(DZ.dtype.element_ty), mask=m)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target_logits: Tensor, rows: Optional[Tensor], temperature: float):
        n, v = logits.shape
        ce = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse_z, lse_t = torch.empty_like(ce), torch.empty_like(ce)
        arg = torch.empty(n, dtype=torch.int64, device=logits.device)
        flags = rows if rows is not None else ce  # a placeholder pointer when every row is live
        _soft_ce_fwd_kernel[(n,)](
            logits,
            target_logits,
            flags,
            ce,  # the target row index's placeholder: row i is scored against target row i
            ce,
            lse_z,
            lse_t,
            arg,
            v,
            1.0 / temperature,
            0.0,
            HAS_ROWS=rows is not None,
            HAS_IDX=False,
            GRAD=False,
            BLOCK=_BLOCK,
        )
        ctx.save_for_backward(logits, target_logits, flags, lse_z, lse_t)
        ctx.has_rows, ctx.inv_temp = rows is not None, 1.0 / temperature
        ctx.mark_non_differentiable(arg)
        return ce, arg

    @staticmethod
    def backward(ctx, g_ce: Tensor, _g_arg):
        logits, target_logits, flags, lse_z, lse_t = ctx.saved_tensors
        n, v = logits.shape
        dz = torch.empty_like(logits)
        _soft_ce_bwd_kernel[(n, triton.cdiv(v, _BLOCK))](
            logits,
            target_logits,
            flags,
            lse_z,
            lse_t,
            g_ce.float().contiguous(),
            dz,
            v,
            ctx.inv_temp,
            HAS_ROWS=ctx.has_rows,
            BLOCK=_BLOCK,
        )
        return dz, None, None, None


def _torch_kernel(op: str, kernel: str) -> bool:
    """True for kernel torch (the reference), False for triton; anything else, or triton without the
    package, is one error naming the valid kernels."""
    if kernel == "torch":
        return True
    if kernel != "triton" or triton is None:
        raise ValueError(
            f"{op}: kernel={kernel!r}; valid: {list(SOFT_CE_KERNELS)}"
            + (" (triton is not installed)" if kernel == "triton" else "")
        )
    return False


class _LinearSoftCrossEntropy(torch.autograd.Function):
    """The lm_head and the soft cross-entropy in one forward that also forms hidden's gradient (module doc)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # the matrix products follow the caller's autocast
    def forward(ctx, hidden: Tensor, weight: Tensor, target_logits: Tensor, index: Tensor, temperature: float, scale):
        z = (hidden.to(weight.dtype) @ weight.T).contiguous()  # [M, V] (bf16 under autocast)
        m, v = z.shape
        ce = torch.empty(m, dtype=torch.float32, device=z.device)
        lse_z, lse_t = torch.empty_like(ce), torch.empty_like(ce)
        arg = torch.empty(m, dtype=torch.int64, device=z.device)
        if m:
            _soft_ce_fwd_kernel[(m,)](
                z, target_logits, ce, index, ce, lse_z, lse_t, arg, v, 1.0 / temperature, float(scale),
                HAS_ROWS=False, HAS_IDX=True, GRAD=True, BLOCK=_BLOCK,
            )  # fmt: skip
        grad = z @ weight  # [M, H]: scale * (softmax(z) - p) @ weight, the gradient at an incoming grad of 1
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(ce, arg)
        return ce.sum() * scale, ce, arg

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g_loss: Tensor, _g_ce, _g_arg):
        (grad,) = ctx.saved_tensors
        return (grad * g_loss).to(ctx.hidden_dtype), None, None, None, None, None


def linear_soft_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target_logits: Tensor,
    temperature: float,
    index: Tensor,
    scale: float,
    kernel: str = "torch",
    probs: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(scale * sum(ce), ce [M] fp32, argmax [M]) of the logits hidden @ weight.T against target rows
    `index`; `weight` frozen. kernel torch: the logits formed and scored by the reference, autograd's
    backward; triton: fused (the module doc)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_soft_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be "
            "[M, H] and [V, H]"
        )
    if target_logits.dim() != 2 or target_logits.shape[1] != weight.shape[0] or index.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_soft_cross_entropy: target_logits {tuple(target_logits.shape)} must be [R, V={weight.shape[0]}] "
            f"and index {tuple(index.shape)} [M={hidden.shape[0]}]"
        )
    if weight.requires_grad:
        raise ValueError("linear_soft_cross_entropy: weight must be frozen (requires_grad=False): the lm_head")
    if _torch_kernel("linear_soft_cross_entropy", kernel):
        z = hidden.to(weight.dtype) @ weight.T  # [M, V]: the lm_head's dtype, as under autocast
        ce, arg = soft_cross_entropy_reference(z, target_logits, temperature, None, probs, index)
        return ce.sum() * scale, ce.detach(), arg
    return _LinearSoftCrossEntropy.apply(
        hidden, weight, target_logits.contiguous(), index.contiguous(), temperature, scale
    )


def soft_cross_entropy(
    logits: Tensor,
    target_logits: Tensor,
    temperature: float = 1.0,
    rows: Optional[Tensor] = None,
    kernel: str = "torch",
    probs: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(ce [N] fp32, argmax [N]); `kernel`: torch (the reference) or triton (the fused kernels)."""
    if logits.dim() != 2 or target_logits.shape != logits.shape:
        raise ValueError(
            f"soft_cross_entropy: logits {tuple(logits.shape)} and target_logits "
            f"{tuple(target_logits.shape)} must both be [N, V], the same shape"
        )
    if _torch_kernel("soft_cross_entropy", kernel):
        return soft_cross_entropy_reference(logits, target_logits, temperature, rows, probs)
    rows = rows.to(torch.uint8).contiguous() if rows is not None else None
    return _SoftCrossEntropy.apply(logits.contiguous(), target_logits.contiguous(), rows, temperature)
