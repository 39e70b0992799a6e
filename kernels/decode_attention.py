"""Decode / verify attention over the static KV cache, reading only each query's live prefix.

    q       [batch, heads, t, head_dim]          t: 1 (decode) or k + 1 (verify), small; any strides
                                                 with a unit last dim (the eager path passes a
                                                 transposed view of [batch, t, heads, head_dim])
    k, v    [batch, kv_heads, slots, head_dim]   one layer of engine.model.StaticKVCache
    qpos    [batch, t] int64                     query (b, i) attends slots 0..qpos[b, i]
    qlo     [batch, t] int64, optional           ... and only from slot qlo[b, i] on (a sliding window:
                                                 DFlash's context window; None: from slot 0)
    -> out  [batch, heads, t, head_dim]          q's dtype, q's memory layout

Flash-decoding: two kernels, split-KV then combine.

1. `_split_kernel`, grid (batch, kv_heads * row_blocks, programs). The query rows that read a kv
   head, GROUP = heads / kv_heads query heads x t tokens, are tiled in blocks of ROWS: 16 (tl.dot's
   minimum) for t <= SMALL_T (decode, verify, draft steps), MAX_ROWS = 64 for longer t (prefill); t is
   a runtime argument, so prompt lengths do not recompile. A program walks the cache in blocks of
   BLOCK_N slots, split s taking blocks s, s + num_splits, s + 2 * num_splits, ... up to the largest
   live length among its rows, loads each K / V block once for all its rows (q @ k^T and p @ v as
   tl.dot, fp32 accumulation) and masks per row (slot <= qpos[b, i], and slot >= qlo[b, i] when windowed:
   a split starts at its first block that reaches the lowest window start among its rows, so a sliding
   layer reads its window, not the whole prefix; a block all rows mask would add exactly nothing). It
   keeps an online softmax per row and writes its partial result: the normalised output and its
   log-sum-exp (log2 domain), into fp32 workspaces
       o_part [batch, heads, t, num_splits, head_dim],  lse_part [batch, heads, t, num_splits]
   A split that saw no live slot for a row writes o = 0, lse = -inf.
2. `_combine_kernel`, grid (batch, heads, t): out = sum_s 2^(lse_s - lse_max) o_s / sum_s 2^(lse_s -
   lse_max), in q's dtype. Splits with lse = -inf weigh 0; split 0 always sees slot 0.
With a single split (a cache of one block, or num_splits=1) the split kernel writes the final output
itself (DIRECT): one launch, no workspace, no combine.

Program p computes splits p, p + programs, ... in turn: a split each up to batch 8 or so, fewer programs
than splits past `TARGET_PROGRAMS` in the grid (`programs_for`), where a program apiece for 32 mostly idle
splits costs more than the splits' work. Such a grid is bound by its traffic, so it runs LAZY: a program
past its tile's live prefix loads no q, an idle split writes lse alone, and the combine reads o only where
lse is finite. A small grid is bound by latency: there every split writes its o and the combine loads o
beside lse. A split's partial, and so the output, is the same bits whichever program computes it.

num_splits comes from the cache size alone (`num_splits_for`: one per block of the cache, at most
MAX_SPLITS), never from the live length, the batch, or whether a CUDA graph is being captured; the loop
bounds are read on the device from qpos. So the grid is fixed for a given cache, and a CUDA graph
captured once stays valid as sequences grow; the work still follows the live length (splits past it
write only their empty partials, or on a LAZY grid their lse). Interleaving the blocks over splits,
rather than giving each split a contiguous chunk of the cache, keeps the splits busy when the live
prefix is short.

Batch invariance: a (batch row, head, query) output is bitwise the same whether the query is a decode
(t = 1), one of a verify's k + 1 tokens, or beside other batch rows, eager or captured. Batch rows are
separate programs; the split count, and with it which split reads which block, depends on the cache
only; decode and verify share ROWS = 16 (one binary: t and the row-block count are not specialised
on), so a row's scores, softmax and p @ v run on the same tile shapes and layouts whichever tile
position it has; and the blocks a tile reads past a row's own live length (up to the tile's largest)
are masked to p = 0, which adds exact zeros and rescales by exactly 1. A row's output never depends
on the other rows of its tile. (Prefill's ROWS = 64 is another binary: a prompt's attention need not
match its decode bits.) The price: an eager call on a cache of several blocks is two launches (split
and combine), where a single split used to be one.

On an H200 (SmolLM2-135M: 9 heads on 3 kv heads, head_dim 64, bf16, a 2049-slot cache, batch 1,
timed in a CUDA graph) a call takes 4.3 us at 300 live slots and 4.5 us at 2000, against 7.8 us and
42 us for one program per (row, head, token) walking the prefix serially: at batch 1 it is about
two launches' latency (the combine alone is 1.5 us), nearly flat in the live length.

`decode_attention_reference` is the plain-torch definition the kernels are tested against (under
TRITON_INTERPRET=1 on CPU, and on the GPU).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.runtime import pdl, triton

if triton is not None:
    import triton.language as tl

    from kernels.runtime import await_prior

MAX_SPLITS = 32
TARGET_PROGRAMS = 2048  # split programs in all above which a program computes several splits (programs_for)
SMALL_T = 16  # t up to this (decode, verify, draft steps) takes row tiles of 16, longer t (prefill) of MAX_ROWS
MAX_ROWS = 64  # query rows per split program for long t; longer t is tiled over programs
_LOG2E = 1.4426950408889634


def slot_mask(qpos: Tensor, qlo: Tensor | None, kv_len: int) -> Tensor:
    """[b, 1, t, kv_len] bool: query (b, i) reads slots qlo[b, i]..qpos[b, i] (from 0 without qlo)."""
    key_pos = torch.arange(kv_len, device=qpos.device)
    seen = key_pos[None, None, :] <= qpos[:, :, None]  # [b, t, kv_len]
    if qlo is not None:
        seen = seen & (key_pos[None, None, :] >= qlo[:, :, None])
    return seen[:, None]


def decode_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, qpos: Tensor, qlo: Tensor | None = None, scale: float | None = None
) -> Tensor:
    kv_len = int(qpos.max()) + 1
    mask = slot_mask(qpos, qlo, kv_len)  # [b, 1, t, kv_len]
    return F.scaled_dot_product_attention(
        q, k[:, :, :kv_len], v[:, :, :kv_len], attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1], scale=scale
    )


if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _one_split(
        q, n, n_max, lo, lo_min, valid, h, i, d, b, k_base, v_base, s_ks, s_vs, qk_scale,
        O_PART, LSE_PART, OUT, s_wb, s_wh, s_wt, s_ob, s_oh, s_ot,
        split,
        ROWS: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DIRECT: tl.constexpr,
        WINDOWED: tl.constexpr,
        LAZY: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One split's partial over its blocks split, split + NUM_SPLITS, ...: o and lse (or OUT if DIRECT)."""
        first = split * BLOCK_N  # this split's first block: split, split + NUM_SPLITS, ...
        if WINDOWED:
            below = tl.maximum(lo_min // BLOCK_N - split + NUM_SPLITS - 1, 0) // NUM_SPLITS
            first = (split + below * NUM_SPLITS) * BLOCK_N  # this split's first block that reaches lo_min
        m_i = tl.full([ROWS], float("-inf"), tl.float32)  # running max (log2 domain)
        l_i = tl.zeros([ROWS], tl.float32)  # running sum of 2^(s - m_i)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for start in range(first, n_max, NUM_SPLITS * BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            in_prefix = offs < n_max  # slots below n_max hold written K / V (finite)
            k_ptr = k_base + offs[None, :] * s_ks + d[:, None]
            kt = tl.load(k_ptr, mask=in_prefix[None, :], other=0.0)  # [D, BLOCK_N]
            s = tl.dot(q, kt.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale  # [ROWS, BLOCK_N]
            live = offs[None, :] < n[:, None]  # [ROWS, BLOCK_N]
            if WINDOWED:
                live = live & (offs[None, :] >= lo[:, None])
            s = tl.where(live, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [ROWS]
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing live yet: no NaN
            p = tl.exp2(s - m_use[:, None])  # [ROWS, BLOCK_N]
            alpha = tl.exp2(m_i - m_use)  # [ROWS]
            v_ptr = v_base + offs[:, None] * s_vs + d[None, :]
            v = tl.load(v_ptr, mask=in_prefix[:, None], other=0.0)  # [BLOCK_N, D]
            pv = tl.dot(p.to(v_base.dtype.element_ty).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv  # [ROWS, D]
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        seen = l_i > 0.0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]  # [ROWS, D]
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # [ROWS]
        if DIRECT:  # the only split: its normalised output is the answer
            out_ptr = OUT + b * s_ob + h[:, None] * s_oh + i[:, None] * s_ot + d[None, :]
            tl.store(out_ptr, o.to(OUT.dtype.element_ty), mask=valid[:, None])
        else:
            part = b * s_wb + h * s_wh + i * s_wt + split  # [ROWS] index of (b, h, i, split) in lse_part
            tl.store(LSE_PART + part, lse, mask=valid)
            o_mask = valid[:, None]
            if LAZY:  # an idle split's o: never read by the combine
                o_mask = (valid & seen)[:, None]
            tl.store(O_PART + part[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask)

    @triton.jit(do_not_specialize=["T", "ROW_BLOCKS", "PROGRAMS"])  # decode (t = 1): the same binary as a verify
    def _split_kernel(
        Q,
        K,
        V,
        QPOS,
        QLO,
        O_PART,
        LSE_PART,
        OUT,
        qk_scale,
        s_qb,
        s_qh,
        s_qt,
        s_kb,
        s_kh,
        s_ks,
        s_vb,
        s_vh,
        s_vs,
        s_pb,
        s_pt,
        s_lb,
        s_lt,
        s_wb,
        s_wh,
        s_wt,  # lse_part's strides; o_part is lse_part's layout with a trailing HEAD_DIM
        s_ob,
        s_oh,
        s_ot,  # OUT's strides (DIRECT: one split writes the final output, no combine)
        T,
        ROW_BLOCKS,
        PROGRAMS,  # programs a tile: program p computes splits p, p + PROGRAMS, ... (PROGRAMS <= NUM_SPLITS)
        GROUP: tl.constexpr,
        ROWS: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DIRECT: tl.constexpr,
        WINDOWED: tl.constexpr,
        LAZY: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):
        await_prior(USE_GDC)
        b, pid, program = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kvh, rb = pid // ROW_BLOCKS, pid % ROW_BLOCKS
        r = rb * ROWS + tl.arange(0, ROWS)  # row r of this kv head: query head kvh * GROUP + r // T, token r % T
        valid = r < GROUP * T
        h = kvh * GROUP + r // T  # [ROWS]
        i = r % T  # [ROWS]
        d = tl.arange(0, HEAD_DIM)
        n = tl.load(QPOS + b * s_pb + i * s_pt, mask=valid, other=-1) + 1  # [ROWS] live slots, 0 for padding
        n_max = tl.max(n, 0)
        lo, lo_min = n, 0  # no window: unread
        if WINDOWED:  # [ROWS] first live slot of each row (its sliding window's start)
            lo = tl.load(QLO + b * s_lb + i * s_lt, mask=valid, other=0)
            lo_min = tl.min(tl.where(valid, lo, n_max), 0)  # below it no row of the tile reads a slot

        q_ptr = Q + b * s_qb + h[:, None] * s_qh + i[:, None] * s_qt + d[None, :]
        busy = valid
        if LAZY:  # [ROWS] rows with a live slot in this program's splits: an idle program loads no q
            busy = valid & (n > program * BLOCK_N)
        q = tl.load(q_ptr, mask=busy[:, None], other=0.0).to(K.dtype.element_ty).to(DOT_DTYPE)  # [ROWS, D]
        k_base = K + b * s_kb + kvh * s_kh
        v_base = V + b * s_vb + kvh * s_vh

        if LAZY:  # each split's partial is the same whichever program computes it
            for split in range(program, NUM_SPLITS, PROGRAMS):
                _one_split(
                    q, n, n_max, lo, lo_min, valid, h, i, d, b, k_base, v_base, s_ks, s_vs, qk_scale,
                    O_PART, LSE_PART, OUT, s_wb, s_wh, s_wt, s_ob, s_oh, s_ot, split,
                    ROWS, NUM_SPLITS, DIRECT, WINDOWED, LAZY, HEAD_DIM, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
                )  # fmt: skip
        else:  # a split a program: no loop around it
            _one_split(
                q, n, n_max, lo, lo_min, valid, h, i, d, b, k_base, v_base, s_ks, s_vs, qk_scale,
                O_PART, LSE_PART, OUT, s_wb, s_wh, s_wt, s_ob, s_oh, s_ot, program,
                ROWS, NUM_SPLITS, DIRECT, WINDOWED, LAZY, HEAD_DIM, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
            )  # fmt: skip

    @triton.jit
    def _combine_kernel(
        O_PART,
        LSE_PART,
        OUT,
        s_wb,
        s_wh,
        s_wt,
        s_ob,
        s_oh,
        s_ot,
        NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        LAZY: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):
        await_prior(USE_GDC)
        b, h, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        sp = tl.arange(0, SPLITS_P2)
        d = tl.arange(0, HEAD_DIM)
        part = b * s_wb + h * s_wh + i * s_wt + sp  # [SPLITS_P2] index of (b, h, i, split) in lse_part
        lse = tl.load(LSE_PART + part, mask=sp < NUM_SPLITS, other=float("-inf"))  # [SPLITS_P2]
        lse_max = tl.max(lse, 0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        wt = tl.exp2(lse - lse_max)  # [SPLITS_P2], 0 for empty splits
        o_ptr = O_PART + part[:, None] * HEAD_DIM + d[None, :]
        if LAZY:  # a large grid: read only the o that was written (the load waits on lse)
            o = tl.load(o_ptr, mask=(lse > float("-inf"))[:, None], other=0.0)  # [SPLITS_P2, D]
        else:  # a small one: every split wrote its o (zeros where idle), loaded beside lse
            o = tl.load(o_ptr, mask=sp[:, None] < NUM_SPLITS, other=0.0)  # [SPLITS_P2, D]
        out = tl.sum(o * wt[:, None], 0) / tl.maximum(tl.sum(wt, 0), 1e-30)  # [D]
        tl.store(OUT + b * s_ob + h * s_oh + i * s_ot + d, out.to(OUT.dtype.element_ty))


def num_splits_for(slots: int, block_n: int) -> int:
    """Splits per (batch row, kv head, row block) tile: one per block of the cache, at most MAX_SPLITS. From
    the cache size alone: not the live length (a captured graph stays valid), not the batch or capture
    (a row's result is the same in any batch, eager or replayed)."""
    return max(1, min(MAX_SPLITS, triton.cdiv(slots, block_n)))


def programs_for(tiles: int, num_splits: int) -> int:
    """Split programs a (batch row, kv head, row block) tile: every split its own program while the grid
    is small (batch 1-8: a short prefix's few live blocks spread over the SMs); past TARGET_PROGRAMS in
    all, fewer, each computing several splits in turn (at batch 64 most of 32 splits find no live
    block, and a program apiece costs more than their work). The splits and their partials stay the same."""
    return max(1, min(num_splits, triton.cdiv(TARGET_PROGRAMS, tiles)))


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qpos: Tensor,
    block_n: int = 64,
    num_splits: int | None = None,
    qlo: Tensor | None = None,
    scale: float | None = None,
    programs: int | None = None,
) -> Tensor:
    """Split-KV Triton kernels (see module docstring); the reference where triton is missing.
    `num_splits` / `programs` override the rules in `num_splits_for` / `programs_for` (tests, benchmarks);
    `qlo`: each query's first slot;
    `scale`: the scores' factor (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)."""
    if triton is None:
        return decode_attention_reference(q, k, v, qpos, qlo, scale)
    b, heads, t, d = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    group = heads // kv_heads
    assert heads == group * kv_heads and k.dtype == v.dtype
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and q.stride(-1) == 1 and d >= 16 and d & (d - 1) == 0
    # tl.dot on the cache's dtype (bf16 tensor cores); the interpreter's bf16 dot is wrong (Triton
    # 3.9), so there the operands, already rounded to the cache's dtype, are multiplied in fp32
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    dot_dtype = tl.float32 if interpret or k.dtype == torch.float32 else _TL_DTYPES[k.dtype]
    # one tile shape for every decode / verify / draft step (see the module docstring); prefill's own
    rows = 16 if t <= SMALL_T else MAX_ROWS  # query rows per program
    row_blocks = triton.cdiv(group * t, rows)
    if num_splits is None:
        num_splits = num_splits_for(slots, block_n)
    out = torch.empty_like(q)  # q's layout: the caller's transpose(1, 2).reshape is then free
    direct = num_splits == 1
    o_part = lse_part = out  # unused placeholders when direct
    if not direct:
        o_part = torch.empty(b, heads, t, num_splits, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(b, heads, t, num_splits, dtype=torch.float32, device=q.device)
    # both contiguous: o_part's element (b, h, i, s, :) sits at lse_part's index * d
    s_w = lse_part.stride()[:3] if not direct else (0, 0, 0)
    lo = qpos if qlo is None else qlo  # a placeholder without a window: WINDOWED=False never reads it
    if programs is None:
        programs = programs_for(b * kv_heads * row_blocks, num_splits)
    lazy = programs < num_splits  # a grid this large is bound by its traffic, not its latency
    gdc = pdl(q.device)
    _split_kernel[(b, kv_heads * row_blocks, programs)](
        q,
        k,
        v,
        qpos,
        lo,
        o_part,
        lse_part,
        out,
        _LOG2E / math.sqrt(d) if scale is None else _LOG2E * scale,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        qpos.stride(0),
        qpos.stride(1),
        *lo.stride(),
        *s_w,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        t,
        row_blocks,
        programs,
        GROUP=group,
        ROWS=rows,
        NUM_SPLITS=num_splits,
        DIRECT=direct,
        WINDOWED=qlo is not None,
        LAZY=lazy,
        HEAD_DIM=d,
        BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        USE_GDC=gdc,
        num_warps=4,
        launch_pdl=gdc,
    )
    if not direct:
        _combine_kernel[(b, heads, t)](
            o_part,
            lse_part,
            out,
            *s_w,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            HEAD_DIM=d,
            LAZY=lazy,
            USE_GDC=gdc,
            num_warps=1,
            launch_pdl=gdc,
        )
    return out
