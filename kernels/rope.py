"""RoPE with a backward, for draft training: the projection's output rotated and laid out per head.

    rope(x, cos, sin, heads, out_dtype=None, kernel="torch") -> y
        x         [B, T, heads * D]  a q or k projection's output (bf16 under autocast), differentiable
        cos, sin  [B, T, D]          fp32 rows of the rotation (half-rotation layout: cos = cat(c, c))
        y         [B, heads, T, D]   x1 * cos - x2 * sin | x2 * cos + x1 * sin per half, in fp32 math,
                                     rounded to out_dtype (None: the promoted dtype of x and cos)

The plain-torch path (engine.model.apply_rope's formula on the transposed view) is about five kernels forward and
as many backward per tensor, over fp32 intermediates; the Triton path is one program per token (all its
heads as one [heads, D/2] tile) each way. Under bf16 autocast the attention casts q and k to bf16
anyway, so `out_dtype=torch.bfloat16` gives it the same values. The backward is the inverse rotation:

    dx1 = dy1 * cos + dy2 * sin,   dx2 = dy2 * cos - dy1 * sin

`rope_reference` is the plain-torch definition the kernels are tested against (TRITON_INTERPRET=1 on CPU,
and on the GPU).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kernels.fused import rotate_half
from kernels.runtime import triton

if triton is not None:
    import triton.language as tl


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, heads: int, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    b, t, _ = x.shape
    c, s = cos[:, None], sin[:, None]  # [B, 1, T, D]
    q = x.view(b, t, heads, -1).transpose(1, 2)  # [B, heads, T, D]
    y = q * c + rotate_half(q) * s  # engine.model.apply_rope
    return y if out_dtype is None else y.to(out_dtype)


if triton is not None:

    @triton.jit
    def _rope_kernel(
        X, COS, SIN, Y, t_len, HEADS: tl.constexpr, D: tl.constexpr, NH: tl.constexpr, INVERSE: tl.constexpr
    ):
        # forward: X [B, T, HEADS * D] -> Y [B, HEADS, T, D]; inverse (the backward): X is dY in Y's
        # layout, Y is dX in X's layout
        tok = tl.program_id(0).to(tl.int64)  # b * t_len + t
        b, t = tok // t_len, tok % t_len
        half = tl.arange(0, D // 2)[None, :]
        h = tl.arange(0, NH)[:, None]
        live = h < HEADS
        c = tl.load(COS + tok * D + half)
        s = tl.load(SIN + tok * D + half)
        flat = tok * HEADS * D + h * D  # [NH, 1]: the token's row in [B, T, HEADS * D]
        per_head = ((b * HEADS + h) * t_len + t) * D  # its rows in [B, HEADS, T, D]
        src, dst = (per_head, flat) if INVERSE else (flat, per_head)
        x1 = tl.load(X + src + half, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(X + src + D // 2 + half, mask=live, other=0.0).to(tl.float32)
        if INVERSE:
            o1, o2 = x1 * c + x2 * s, x2 * c - x1 * s
        else:
            o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        tl.store(Y + dst + half, o1.to(Y.dtype.element_ty), mask=live)
        tl.store(Y + dst + D // 2 + half, o2.to(Y.dtype.element_ty), mask=live)


def _launch(x: Tensor, cos: Tensor, sin: Tensor, y: Tensor, t: int, heads: int, d: int, inverse: bool) -> None:
    _rope_kernel[(cos.shape[0] * t,)](
        x, cos, sin, y, t, HEADS=heads, D=d, NH=triton.next_power_of_2(heads), INVERSE=inverse
    )


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, heads: int, out_dtype: torch.dtype):
        b, t, hd = x.shape
        d = hd // heads
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        y = torch.empty(b, heads, t, d, dtype=out_dtype, device=x.device)
        _launch(x.contiguous(), cos, sin, y, t, heads, d, inverse=False)
        ctx.save_for_backward(cos, sin)
        ctx.heads, ctx.x_dtype = heads, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        cos, sin = ctx.saved_tensors
        b, heads, t, d = dy.shape
        dx = torch.empty(b, t, heads * d, dtype=ctx.x_dtype, device=dy.device)
        _launch(dy.contiguous(), cos, sin, dx, t, heads, d, inverse=True)
        return dx, None, None, None, None


def rope(
    x: Tensor, cos: Tensor, sin: Tensor, heads: int, out_dtype: Optional[torch.dtype] = None, kernel: str = "torch"
) -> Tensor:
    """`kernel`: torch (the reference) or triton (one kernel forward, one backward); cos/sin get no gradient."""
    if kernel == "torch":
        return rope_reference(x, cos, sin, heads, out_dtype)
    if kernel != "triton" or triton is None:
        raise ValueError(
            f"rope: kernel={kernel!r}; valid: ['torch', 'triton']"
            + (" (triton is not installed)" if kernel == "triton" else "")
        )
    return _Rope.apply(x, cos, sin, heads, out_dtype or torch.promote_types(x.dtype, cos.dtype))
