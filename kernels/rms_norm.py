"""RMSNorm with a backward, for draft training: one Triton kernel each way.

    rms_norm(x, weight, eps, out_dtype=None, kernel="torch") -> y
        x       [..., H]  (bf16 or fp32), differentiable
        weight  [H]       (the fp32 master weight while training), differentiable
        y       [..., H]  weight * (x * rsqrt(mean(x^2) + eps)), the normalised value rounded to x's dtype
                          first (as engine.model.RMSNorm and transformers do), then to `out_dtype`
                          (None: the promoted dtype of x and weight, what the module returns)

Under bf16 autocast the module returns fp32 (fp32 weight times bf16 value) and the next projection casts
it back to bf16; `out_dtype=torch.bfloat16` gives the same bf16 values in one pass. In plain torch one
norm is about 7 kernels forward and 10 backward over [rows, H]; the Triton path is one forward
(one program per row, storing rstd [rows] fp32) and one backward (a block of rows per program: dx, and
the weight's gradient summed per program, then over programs):

    dx = rstd * (dxh - xh * mean(dxh * xh)),  dxh = dy * weight,  xh = x * rstd
    dweight = sum_rows dy * round(xh)

`rms_norm_reference` is the plain-torch definition the kernels are tested against (TRITON_INTERPRET=1 on
CPU, and on the GPU).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kernels.fused import add_rmsnorm_reference
from kernels.runtime import triton

if triton is not None:
    import triton.language as tl

_ROWS = 16  # rows per backward program (each writes one partial weight gradient)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    _, y = add_rmsnorm_reference(x, None, weight, eps)  # the inference norm's formula, without a residual
    return y if out_dtype is None else y.to(out_dtype)


if triton is not None:

    @triton.jit
    def _rms_norm_fwd_kernel(X, W, Y, RSTD, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        x = tl.load(X + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
        xh = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + row * n_cols + cols, (w * xh).to(Y.dtype.element_ty), mask=m)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rms_norm_bwd_kernel(X, W, DY, RSTD, DX, DW_PART, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ROWS):
            row = tl.minimum(pid.to(tl.int64) * ROWS + i, n_rows - 1)  # past the end: the last row, not stored
            mm = m & (tl.zeros([BLOCK], dtype=tl.int64) + pid * ROWS + i < n_rows)
            x = tl.load(X + row * n_cols + cols, mask=mm, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * n_cols + cols, mask=mm, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            xh = x * rstd
            dxh = dy * w
            dx = rstd * (dxh - xh * (tl.sum(dxh * xh, 0) / n_cols))
            tl.store(DX + row * n_cols + cols, dx.to(DX.dtype.element_ty), mask=mm)
            dw += dy * xh.to(X.dtype.element_ty).to(tl.float32)
        tl.store(DW_PART + pid * n_cols + cols, dw, mask=m)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype):
        shape, h = x.shape, x.shape[-1]
        x2 = x.reshape(-1, h).contiguous()
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(h)
        _rms_norm_fwd_kernel[(x2.shape[0],)](x2, weight, y, rstd, h, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, weight, rstd = ctx.saved_tensors
        n, h = x2.shape
        programs = triton.cdiv(n, _ROWS)
        dx = torch.empty_like(x2)
        dw_part = torch.empty(programs, h, dtype=torch.float32, device=x2.device)
        _rms_norm_bwd_kernel[(programs,)](
            x2,
            weight,
            dy.reshape(-1, h).contiguous(),
            rstd,
            dx,
            dw_part,
            n,
            h,
            ROWS=_ROWS,
            BLOCK=triton.next_power_of_2(h),
        )
        return dx.view(ctx.shape), dw_part.sum(0).to(weight.dtype), None, None


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, out_dtype: Optional[torch.dtype] = None, kernel: str = "torch"
) -> Tensor:
    """`kernel`: torch (the reference) or triton (one fused kernel forward, one backward)."""
    if kernel == "torch":
        return rms_norm_reference(x, weight, eps, out_dtype)
    if kernel != "triton" or triton is None:
        raise ValueError(
            f"rms_norm: kernel={kernel!r}; valid: ['torch', 'triton']"
            + (" (triton is not installed)" if kernel == "triton" else "")
        )
    return _RMSNorm.apply(x, weight, eps, out_dtype or torch.promote_types(x.dtype, weight.dtype))
