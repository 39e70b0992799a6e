"""Fused elementwise kernels for the decode path: fewer, larger kernels between the matrix products.

    add_rmsnorm(x, delta, weight, eps) -> (h, y)      h = x + delta (the residual stream, fp32 sum
                                                       rounded to x's dtype); y = weight * rmsnorm(h)
        x, delta [rows, hidden]; delta may be None (then h = x)
    rope_cache_write(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads) -> q
        qkv [b, t, (heads + 2 * kv_heads) * d], one fused projection; cos/sin [max_pos, d] (fp32 tables,
        read at positions [b, t] inside the kernel: no gathered copies); RoPE on q and k (half-rotation
        layout), k and v written at cache[b, :, slots[b, t]]; returns q [b, heads, t, d]. heads = 0: k and
        v only (DFlash's context); qkv may be a slice of a wider projection's last dim. q_norm / k_norm
        [d] (Qwen3's q/k norms, eps): each q / k head RMS-normed before RoPE, one token per program

(SwiGLU / GeGLU is the gate / up projection's epilogue: kernels/gemv.py.) Each replaces 6-14 small PyTorch
kernels per call; math in fp32, results rounded to the input dtype
(as transformers rounds RMSNorm's normalised value before the weight). The `*_reference` functions
are the plain-torch definitions they are tested against (TRITON_INTERPRET=1 on CPU, and on the GPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.runtime import pdl, triton

if triton is not None:
    import triton.language as tl

    from kernels.runtime import await_prior


# ------------------------------------------------------------------------------------- references
def add_rmsnorm_reference(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    h = x if delta is None else (x.float() + delta.float()).to(x.dtype)
    hf = h.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return h, (weight.float() * n.float()).to(x.dtype)  # (a float32 weight: Gemma's folded 1 + w)


def rotate_half(x: Tensor) -> Tensor:  # RoPE's half rotation: [x1, x2] -> [-x2, x1]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def head_norm_reference(x: Tensor, weight: Tensor | None, eps: float, dtype: torch.dtype) -> Tensor:
    """x [..., d] fp32 -> each head RMS-normed as RMSNorm does in `dtype` (None: unchanged), in fp32."""
    if weight is None:
        return x
    n = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight.to(dtype) * n).float()


def rope_cache_write_reference(
    qkv, cos, sin, positions, slots, k_cache, v_cache, heads: int, kv_heads: int, q_norm=None, k_norm=None, eps=1e-6
) -> Tensor:
    b, t, _ = qkv.shape
    d = k_cache.shape[-1]
    cos, sin = cos[positions], sin[positions]  # [b, t, d]
    q, k, v = qkv.float().split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = head_norm_reference(q.view(b, t, heads, d), q_norm, eps, qkv.dtype).transpose(1, 2)  # [b, heads, t, d]
    k = head_norm_reference(k.view(b, t, kv_heads, d), k_norm, eps, qkv.dtype).transpose(1, 2)
    v = v.view(b, t, kv_heads, d).transpose(1, 2)
    c, s = cos[:, None].float(), sin[:, None].float()
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    idx = slots[:, None, :, None].expand(b, kv_heads, t, d)
    k_cache.scatter_(2, idx, k.to(k_cache.dtype))
    v_cache.scatter_(2, idx, v.to(v_cache.dtype))
    return q.to(qkv.dtype)


# ------------------------------------------------------------------------------------- kernels
if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(
        X, D, W, H, Y, eps, n_cols, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr
    ):  # fmt: skip
        await_prior(USE_GDC)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        x = tl.load(X + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_DELTA:
            x = x + tl.load(D + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
            x = x.to(H.dtype.element_ty)
            tl.store(H + row * n_cols + cols, x, mask=m)
            x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
        n = (x * rstd).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + row * n_cols + cols, (w * n).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_cache_kernel(
        QKV,
        COS,
        SIN,
        POS,
        SLOTS,
        KC,
        VC,
        QO,
        QN,
        KN,
        eps,
        s_qkv_b,
        s_qkv_t,
        s_cs,
        s_pos_b,
        s_sl_b,
        s_kc_b,
        s_kc_h,
        s_kc_s,
        s_qo_b,
        s_qo_h,
        s_qo_t,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        D: tl.constexpr,
        NH: tl.constexpr,
        NKV: tl.constexpr,
        QK_NORM: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):
        await_prior(USE_GDC)
        # one program per token: its q and k heads as one [NH, D/2] tile (NH: heads + kv_heads, padded
        # to a power of two), its v heads as one [NKV, D] tile
        b, t = tl.program_id(0), tl.program_id(1)
        half = tl.arange(0, D // 2)[None, :]
        h = tl.arange(0, NH)[:, None]  # q heads, then k heads
        pos = tl.load(POS + b * s_pos_b + t)
        cs = COS + pos * s_cs  # this token's row of the tables
        sn = SIN + pos * s_cs
        c1, c2 = tl.load(cs + half), tl.load(cs + D // 2 + half)
        s1, s2 = tl.load(sn + half), tl.load(sn + D // 2 + half)
        row = QKV + b * s_qkv_b + t * s_qkv_t
        live = h < HEADS + KV_HEADS
        x1 = tl.load(row + h * D + half, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(row + h * D + D // 2 + half, mask=live, other=0.0).to(tl.float32)
        is_q = h < HEADS
        if QK_NORM:  # each head RMS-normed over D (both halves), rounded as RMSNorm rounds, then weighted
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]  # [NH, 1]
            w1 = tl.where(is_q, tl.load(QN + half).to(tl.float32), tl.load(KN + half).to(tl.float32))
            w2 = tl.where(is_q, tl.load(QN + D // 2 + half).to(tl.float32), tl.load(KN + D // 2 + half).to(tl.float32))
            x1 = (w1 * (x1 * rstd).to(QO.dtype.element_ty).to(tl.float32)).to(QO.dtype.element_ty).to(tl.float32)
            x2 = (w2 * (x2 * rstd).to(QO.dtype.element_ty).to(tl.float32)).to(QO.dtype.element_ty).to(tl.float32)
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
        out = QO + b * s_qo_b + tl.where(is_q, h, 0) * s_qo_h + t * s_qo_t
        tl.store(out + half, o1.to(QO.dtype.element_ty), mask=is_q)
        tl.store(out + D // 2 + half, o2.to(QO.dtype.element_ty), mask=is_q)
        is_k = live & (h >= HEADS)
        slot = tl.load(SLOTS + b * s_sl_b + t)
        kdst = KC + b * s_kc_b + tl.where(is_k, h - HEADS, 0) * s_kc_h + slot * s_kc_s
        tl.store(kdst + half, o1.to(KC.dtype.element_ty), mask=is_k)
        tl.store(kdst + D // 2 + half, o2.to(KC.dtype.element_ty), mask=is_k)
        vh = tl.arange(0, NKV)[:, None]
        full = tl.arange(0, D)[None, :]
        is_v = vh < KV_HEADS
        v = tl.load(row + (HEADS + KV_HEADS + vh) * D + full, mask=is_v, other=0.0)
        tl.store(VC + b * s_kc_b + vh * s_kc_h + slot * s_kc_s + full, v.to(VC.dtype.element_ty), mask=is_v)


def add_rmsnorm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if triton is None:
        return add_rmsnorm_reference(x, delta, weight, eps)
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    d2 = delta.reshape(-1, n).contiguous() if delta is not None else x2
    h = torch.empty_like(x2) if delta is not None else x2
    y = torch.empty_like(x2)
    gdc = pdl(x2.device)
    _add_rmsnorm_kernel[(x2.shape[0],)](
        x2, d2, weight, h, y, eps, n, HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n), USE_GDC=gdc,
        launch_pdl=gdc,
    )  # fmt: skip
    return h.view(shape), y.view(shape)


def rope_cache_write(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    slots: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    heads: int,
    kv_heads: int,
    q_norm: Tensor | None = None,
    k_norm: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    if triton is None:
        return rope_cache_write_reference(
            qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads, q_norm, k_norm, eps
        )
    b, t, _ = qkv.shape
    d = k_cache.shape[-1]
    if qkv.stride(-1) != 1:  # a slice of a wider projection (unit inner stride) is read in place
        qkv = qkv.contiguous()
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[-1] == d
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert positions.stride(-1) == 1 and slots.stride(-1) == 1
    q = torch.empty(b, heads, t, d, dtype=qkv.dtype, device=qkv.device)
    assert (q_norm is None) == (k_norm is None) or heads == 0, "q and k norms come together"
    k_w = k_norm if k_norm is not None else cos  # a placeholder pointer when QK_NORM is off
    q_w = q_norm if q_norm is not None else k_w  # heads = 0 (k and v only): no q norm is read
    gdc = pdl(qkv.device)
    _rope_cache_kernel[(b, t)](
        qkv,
        cos,
        sin,
        positions,
        slots,
        k_cache,
        v_cache,
        q,
        q_w,
        k_w,
        eps,
        qkv.stride(0),
        qkv.stride(1),
        cos.stride(0),
        positions.stride(0),
        slots.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        HEADS=heads,
        KV_HEADS=kv_heads,
        D=d,
        NH=triton.next_power_of_2(heads + kv_heads),
        NKV=triton.next_power_of_2(kv_heads),
        QK_NORM=k_norm is not None,
        USE_GDC=gdc,
        launch_pdl=gdc,
    )
    return q
