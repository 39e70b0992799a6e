"""Decode / verify attention over the static KV cache, reading only each query's live prefix.

    q       [batch, heads, t, head_dim]          t: 1 (decode) or k + 1 (verify), small
    k, v    [batch, kv_heads, slots, head_dim]   one layer of engine.model.StaticKVCache
    qpos    [batch, t] int64                     query (b, i) attends slots 0..qpos[b, i]
    -> out  [batch, heads, t, head_dim]

One Triton program per (batch row, query head, query token): it loops over the row's live slots in
blocks of BLOCK_N with an online softmax (running max and sum in fp32), so the work follows the
live length, not the cache size, and the loop bound is read on the device: a CUDA graph captured
once stays valid as sequences grow. GQA: query head h reads kv head h // (heads / kv_heads).

`decode_attention_reference` is the plain-torch definition the kernel is tested against (under
TRITON_INTERPRET=1 on CPU, and on the GPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds without triton: the reference path only
    triton = None


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, qpos: Tensor) -> Tensor:
    kv_len = int(qpos.max()) + 1
    key_pos = torch.arange(kv_len, device=q.device)
    mask = (key_pos[None, None, :] <= qpos[:, :, None])[:, None]  # [b, 1, t, kv_len]
    return F.scaled_dot_product_attention(q, k[:, :, :kv_len], v[:, :, :kv_len], attn_mask=mask,
                                          enable_gqa=k.shape[1] != q.shape[1])


if triton is not None:

    @triton.jit
    def _decode_attention_kernel(
        Q, K, V, QPOS, OUT, scale,
        s_qb, s_qh, s_qt, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_ob, s_oh, s_ot, s_pb, s_pt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        b, h, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kvh = h // GROUP
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + b * s_qb + h * s_qh + t * s_qt + d).to(tl.float32) * scale  # [D]
        n = tl.load(QPOS + b * s_pb + t * s_pt) + 1  # live slots for this query
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        k_row = K + b * s_kb + kvh * s_kh
        v_row = V + b * s_vb + kvh * s_vh
        for start in range(0, n, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            live = offs < n
            k = tl.load(k_row + offs[:, None] * s_ks + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            s = tl.where(live, tl.sum(k * q[None, :], 1), float("-inf"))  # [BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, 0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_row + offs[:, None] * s_vs + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        tl.store(OUT + b * s_ob + h * s_oh + t * s_ot + d, (acc / l_i).to(OUT.dtype.element_ty))


def decode_attention(q: Tensor, k: Tensor, v: Tensor, qpos: Tensor, block_n: int = 64) -> Tensor:
    """Triton kernel (see module docstring); the reference where triton is missing."""
    if triton is None:
        return decode_attention_reference(q, k, v, qpos)
    b, heads, t, d = q.shape
    kv_heads = k.shape[1]
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and q.stride(-1) == 1 and d & (d - 1) == 0
    out = torch.empty_like(q)
    _decode_attention_kernel[(b, heads, t)](
        q, k, v, qpos, out, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        qpos.stride(0), qpos.stride(1),
        GROUP=heads // kv_heads, HEAD_DIM=d, BLOCK_N=block_n,
    )
    return out
