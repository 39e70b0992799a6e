"""Batch-invariant projections for decode / verify / draft steps (M = 1..256 rows), with the norm before
them fused into their prologue and the gated activation (SwiGLU, GeGLU) or the greedy argmax into their epilogue.

    gemv(x, w, bias=None) -> y                              y = x @ w^T (+ bias)
    add_rmsnorm_gemv(x, delta, norm_w, eps, w, bias=None)   h = x + delta (x when delta is None);
        -> (h, y)                                           y = rmsnorm(h; norm_w) @ w^T (+ bias)
        glu=act: w's rows interleaved gate / up (interleave_gate_up): y = act(gate) * up [M, N / 2], act
        one of GLU_EPILOGUES (HF's names: silu, gelu_pytorch_tanh)
    cat_rmsnorm_gemv(x1, x2, norm_w1, norm_w2, eps, w, ...) y = [rmsnorm(x1_row), rmsnorm(x2_row)] @ w^T;
        index1: x1 is a table [V, K1] read at rows index1[m] (the embedding lookup fused in); norm=False: as is;
        zero1: the rows m with zero1[m] read x1 as zeros (public MTP layers' token embedding at position 0)
    argmax=True: ids = argmax_n round(y) (+ offsets[ids]; EAGLE3's d2t) instead of y, the first index on ties

Layouts (nn.Linear's): x, delta, h [..., K] (any row stride, unit last stride; leading dims flattened into
M rows); w [N, K] (unit last stride); y [..., N] in x's dtype; ids [...] int64. Fresh outputs every call.

Invariants: a row's outputs are bitwise the same whatever M is and wherever the row sits (MMA k-steps in
one order over K, the norm's sum of squares in fixed lanes and a fixed tree, no FMA contraction), and the
norm is applied after the product: y = rstd * (round(h * norm_w) @ w^T). Up to FUSED_M rows the norm is
fused into the product's prologue (where K <= FUSED_K or the epilogue is gated); otherwise a pre-pass
normalises each row once (`norm_first`). docs/architecture.md says
why and how; the `*_reference` functions are the definitions (rounding points included).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.runtime import pdl, triton

if triton is not None:
    import triton.language as tl

    from kernels.runtime import await_prior

ROW_TILES = (16, 64, 128)  # rows of one program: 16 up to 16 rows (decode, a verify), 64, 128 (`row_tile`)
FUSED_M = 16  # calls of up to this many rows fuse the norm into the product; larger ones normalise rows first
FUSED_K = 2048  # ... where K is at most this, or the epilogue is gated (`norm_first`)
ONE_TILE_M = 64  # calls of up to this many rows run one row tile; larger ones several
NARROW_N = 1024  # ... but a weight of at most this many columns: 16-row tiles up to ONE_TILE_M rows (more programs)
_SMS = 132  # an H100 / H200's SMs: narrow weights take the most programs that fit one wave
_PROGRAMS = 96  # up to FUSED_M rows: the widest column tile that still gives this many programs (else 16)
_STAGES = {16: 5, 32: 5, 64: 3, 128: 3}  # chunks in flight per column tile width, up to FUSED_M rows
BLOCK_K = 128  # columns of a chunk of K, and lanes of the norm's sum of squares
WIDE_BLOCK_K = 64  # columns of a short chunk, past ONE_TILE_M rows (the norm is a pre-pass there: no lanes)
_WIDE_STAGES = 6  # short chunks in flight at most
_SMEM_BUDGET = 192 * 1024  # bytes of pipelined load buffers a program may hold (H100 / H200: 227 KB in all)
PREFETCH_K = 256  # under programmatic dependent launch: columns of each weight row prefetched before the wait
_PLAIN, _RMSNORM = 0, 1  # prologues
GLU_ACTS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}  # the references
GLU_EPILOGUES = {"silu": 1, "gelu_pytorch_tanh": 2}  # the kernel's GLU constexpr (0: no gated epilogue)


# ------------------------------------------------------------------------------------- references
def gemv_reference(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    y = x.float() @ w.float().t()  # [M, N], fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def rstd_reference(h: Tensor, eps: float) -> Tensor:
    """1 / sqrt(mean(h^2) + eps) [..., 1] fp32 with the kernels' order: lane j of BLOCK_K sums h^2 over
    columns j, BLOCK_K + j, ... in order, then adjacent lanes pairwise (seven levels); IEEE sqrt and division."""
    hf = h.float()
    k = hf.shape[-1]
    sq = torch.nn.functional.pad(hf * hf, (0, -k % BLOCK_K)).unflatten(-1, (-1, BLOCK_K))  # [..., chunks, BLOCK_K]
    ss = torch.zeros_like(sq[..., 0, :])
    for c in range(sq.shape[-2]):
        ss = ss + sq[..., c, :]
    while ss.shape[-1] > 1:
        ss = ss[..., 0::2] + ss[..., 1::2]
    return 1.0 / torch.sqrt(ss / k + eps)


def _normed_rows(h: Tensor, norm_w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """h [..., K] -> (round(h * norm_w) [..., K] in h's dtype, rstd [..., 1] fp32): the product's operand
    and the scale applied to its output."""
    return (h.float() * norm_w.float()).to(h.dtype), rstd_reference(h, eps)


def add_rmsnorm_gemv_reference(
    x: Tensor, delta: Tensor | None, norm_w: Tensor, eps: float, w: Tensor, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    h = x if delta is None else (x.float() + delta.float()).to(x.dtype)
    a, rstd = _normed_rows(h, norm_w, eps)
    y = (a.float() @ w.float().t()) * rstd
    return h, (y if bias is None else y + bias.float()).to(x.dtype)


def cat_rmsnorm_gemv_reference(
    x1: Tensor,
    x2: Tensor,
    norm_w1: Tensor | None,
    norm_w2: Tensor | None,
    eps: float,
    w: Tensor,
    bias: Tensor | None = None,
    *,
    index1: Tensor | None = None,
    norm: bool = True,
    zero1: Tensor | None = None,
) -> Tensor:
    a1 = x1 if index1 is None else x1[index1]  # [..., K1]
    if zero1 is not None:
        a1 = a1.masked_fill(zero1[..., None], 0)
    if not norm:
        return gemv_reference(torch.cat([a1, x2], -1), w, bias)
    k1 = a1.shape[-1]
    (a1, r1), (a2, r2) = _normed_rows(a1, norm_w1, eps), _normed_rows(x2, norm_w2, eps)
    y = (a1.float() @ w[:, :k1].float().t()) * r1 + (a2.float() @ w[:, k1:].float().t()) * r2
    return (y if bias is None else y + bias.float()).to(x2.dtype)


def interleave_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """[I, ...] gate and up rows (weights or biases) -> [2I, ...] in the order g0, u0, g1, u1, ...: the
    layout whose output tile holds matching gate / up columns (add_rmsnorm_gemv's gated epilogue)."""
    return torch.stack([gate, up], 1).reshape(2 * gate.shape[0], *gate.shape[1:])


def glu_reference(gu: Tensor, act: str = "silu") -> Tensor:
    """Interleaved [..., 2I] (g0, u0, g1, u1, ...) -> round(act(g) * u) [..., I], computed in fp32."""
    return (GLU_ACTS[act](gu[..., 0::2].float()) * gu[..., 1::2].float()).to(gu.dtype)


def argmax_reference(y: Tensor, offsets: Tensor | None = None) -> Tensor:
    """The greedy token of logits y [..., N] (the first index of the maximum), mapped by offsets."""
    ids = y.argmax(-1)
    return ids if offsets is None else ids + offsets[ids]


# ------------------------------------------------------------------------------------- kernels
if triton is not None:

    @triton.jit
    def _round(x, DT: tl.constexpr, RNE: tl.constexpr):
        """fp32 -> fp32 holding the nearest DT value. RNE: round to bf16 to nearest even by hand (the
        interpreter's fp32 -> bf16 cast truncates; the GPU's rounds), after which the cast is exact."""
        if RNE:
            bits = x.to(tl.uint32, bitcast=True)
            half = tl.add((bits >> 16) & 1, 0x7FFF, sanitize_overflow=False)  # half an ulp, + 1 if odd: ties to even
            bits = tl.add(bits, half, sanitize_overflow=False) & 0xFFFF0000  # (no overflow check: slow to interpret)
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _rstd(ss, n_cols, eps):
        """1 / sqrt(mean(h^2) + eps) [R] from the lanes ss [R, BLOCK_K] (lane j: columns j, BLOCK_K + j, ... in
        order): adjacent lanes summed pairwise, seven times (a fixed tree: the same bits in every kernel and
        in rstd_reference), IEEE sqrt and division."""
        for _ in tl.static_range(7):
            a, b = tl.split(tl.reshape(ss, (ss.shape[0], ss.shape[1] // 2, 2)))
            ss = a + b
        return tl.div_rn(1.0, tl.sqrt_rn(tl.reshape(ss, (ss.shape[0],)) / n_cols + eps))

    @triton.jit
    def _prefetch_l2(ptrs, mask, base):
        """A hint: the 128-byte lines at ptrs (where mask; base elsewhere) into L2, nothing returned."""
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [tl.where(mask, ptrs, base)], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _add_chunk(x, d, HAS_DELTA: tl.constexpr, RNE: tl.constexpr):
        """A loaded chunk of one source's rows x, d [R, BLOCK_K] -> h = round(x + d) in fp32 (x without a delta)."""
        h = x.to(tl.float32)
        if HAS_DELTA:
            h = _round(h + d.to(tl.float32), x.dtype, RNE)
        return h

    @triton.jit
    def _norm_chunk(x, d, nw, ss, HAS_DELTA: tl.constexpr, RNE: tl.constexpr):
        """A loaded chunk of one source's rows x, d [R, BLOCK_K] and its norm weight nw [BLOCK_K] ->
        (h = round(x + d) (x without a delta), a = round(h * nw), ss + h^2 by lane)."""
        h = _add_chunk(x, d, HAS_DELTA, RNE)
        ss += h * h
        return h, _round(h * nw.to(tl.float32)[None, :], x.dtype, RNE), ss

    @triton.jit
    def _product(
        acc,
        ss,
        x_rows,  # [ROWS, 1] pointers: the rows of this source
        d_rows,  # [ROWS, 1] pointers: delta's rows (HAS_DELTA)
        h_rows,  # [ROWS, 1] pointers: h's rows (STORE_H)
        NW,  # norm weight of this source [K_HI - K_LO]
        w_cols,  # [1, BLOCK_N] pointers: the columns of w^T
        mmask,
        nmask,
        pid_n,  # this program's column tile of n_tiles: it stores h's chunks c with c % n_tiles == pid_n
        n_tiles,
        K_LO: tl.constexpr,  # this source's columns of w: [K_LO, K_HI)
        K_HI: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NORM: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        STORE_H: tl.constexpr,
        RNE: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """acc [ROWS, BLOCK_N] += a @ w^T[K_LO:K_HI] over one source's chunks in order; with NORM,
        a = round(h * norm_w) and ss [ROWS, BLOCK_K] += h^2 by lane; else a is the source as is.
        STORE_H: h = round(x + delta) stored, each chunk by one column tile's programs (no program
        makes a pass of its own over K for it). NORM's activations feed arithmetic before the dot,
        which the compiler's pipeliner does not prefetch: each iteration loads the next chunk's before
        it uses the current one."""
        KS: tl.constexpr = K_HI - K_LO
        offs_k = tl.arange(0, BLOCK_K)
        if NORM:
            nmk = offs_k < KS
            m2 = mmask[:, None] & nmk[None, :]
            x_n = tl.load(x_rows + offs_k[None, :], mask=m2, other=0.0)  # [ROWS, BLOCK_K]
            d_n = tl.load(d_rows + offs_k[None, :], mask=m2, other=0.0) if HAS_DELTA else x_n
            nw_n = tl.load(NW + offs_k, mask=nmk, other=0.0)  # [BLOCK_K]
        for k0 in range(0, KS, BLOCK_K):
            kk = k0 + offs_k  # [BLOCK_K] columns of this source
            wmask = (kk < KS)[:, None] & nmask[None, :]
            w = tl.load(w_cols + (K_LO + kk)[:, None], mask=wmask, other=0.0, eviction_policy="evict_first")  # [BK, BN]
            if NORM:
                x, d, nw = x_n, d_n, nw_n
                kn = kk + BLOCK_K  # the next chunk
                nmk = kn < KS
                m2 = mmask[:, None] & nmk[None, :]
                x_n = tl.load(x_rows + kn[None, :], mask=m2, other=0.0)
                if HAS_DELTA:
                    d_n = tl.load(d_rows + kn[None, :], mask=m2, other=0.0)
                nw_n = tl.load(NW + kn, mask=nmk, other=0.0)
                h, a, ss = _norm_chunk(x, d, nw, ss, HAS_DELTA, RNE)
                if STORE_H:
                    own = (kk < KS) & ((kk // BLOCK_K) % n_tiles == pid_n)  # [BLOCK_K]: this chunk is ours
                    hmask = mmask[:, None] & own[None, :]
                    tl.store(h_rows + kk[None, :], h.to(x.dtype), mask=hmask)
            else:
                a = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & (kk < KS)[None, :], other=0.0)
            acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        return acc, ss

    @triton.jit(do_not_specialize=["M"])  # one binary per row tile, whatever M
    def _gemv_kernel(
        X1,
        stride_x1,
        IDX1,
        ZERO1,  # [M] uint8: rows whose source 1 reads as zeros (HAS_ZERO1)
        NW1,  # source 1: columns [0, K1); x1[IDX1[m]] if HAS_INDEX
        X2,
        stride_x2,
        NW2,  # source 2: columns [K1, K)
        D,
        stride_d,
        H,  # delta [M, K1], h out [M, K1] contiguous (HAS_DELTA)
        RSTD,  # [M, 2] fp32: each source's rstd (PROLOGUE 2: the sources are already round(h * norm_w))
        W,
        stride_w,  # weight [N, K], unit last stride
        B,  # bias [N] (HAS_BIAS)
        Y,
        stride_y,  # y out [M, N], unit last stride (not ARGMAX)
        PMAX,
        PIDX,  # argmax partials [M, n_tiles] (ARGMAX): max of the rounded row over the tile, its index
        M,
        N,
        eps,
        K: tl.constexpr,
        K1: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PROLOGUE: tl.constexpr,  # 0: plain, 1: RMSNorm per source, 2: normed sources, rstd from RSTD
        HAS_INDEX: tl.constexpr,
        HAS_ZERO1: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ARGMAX: tl.constexpr,
        GLU: tl.constexpr,  # epilogue 1 / 2: y holds [g0, u0, g1, u1, ...]; store round(act(g) * u) [M, N / 2]
        RNE: tl.constexpr,  # round fp32 -> bf16 by hand (the interpreter, bf16 only)
        DOT_DTYPE: tl.constexpr,  # the dot's operand type: the activations' (fp32 under the interpreter)
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands: exact products, no TF32
        USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels/runtime.py)
        PF_LINES: tl.constexpr,  # with it: 128-byte lines of each weight row prefetched before the wait,
        PF_STEP: tl.constexpr,  # of this many elements each
    ):
        DT = X2.dtype.element_ty  # the activations' dtype: every rounding point rounds to it
        TWO: tl.constexpr = K1 < K  # columns [K1, K) come from x2
        FUSED: tl.constexpr = PROLOGUE == 1
        SCALED: tl.constexpr = PROLOGUE != 0  # the output of each source is scaled by its rstd
        m_tiles = tl.cdiv(M, ROWS)  # the row tiles of a column tile run side by side: its weight read once
        pid_n, pid_m = tl.program_id(0) // m_tiles, tl.program_id(0) % m_tiles
        offs_m = pid_m * ROWS + tl.arange(0, ROWS)  # [ROWS] rows of this program
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
        mmask, nmask = offs_m < M, offs_n < N
        w_cols = W + offs_n[None, :] * stride_w  # [1, BLOCK_N]: the columns of w^T
        if USE_GDC:  # the weight is no kernel's output: its first chunks into L2 while the kernel before ends
            line = tl.arange(0, PF_LINES) * PF_STEP  # [PF_LINES] each line's first column
            _prefetch_l2(w_cols + line[:, None], (line < K)[:, None] & nmask[None, :], W)
        await_prior(USE_GDC)
        rows1, mmask1 = offs_m, mmask
        if HAS_INDEX:
            rows1 = tl.load(IDX1 + offs_m, mask=mmask, other=0)  # [ROWS] table rows (an embedding lookup)
        if HAS_ZERO1:  # these rows load source 1 as zeros: h = 0, so its share of y is 0
            mmask1 = mmask & (tl.load(ZERO1 + offs_m, mask=mmask, other=0) == 0)

        acc = tl.full([ROWS, BLOCK_N], 0.0, tl.float32)  # (tl.full: tl.zeros is slow to interpret)
        ss = tl.full([ROWS, BLOCK_K], 0.0, tl.float32)
        X1_rows = X1 + rows1[:, None] * stride_x1
        acc, ss = _product(
            acc,
            ss,
            X1_rows,
            D + offs_m[:, None] * stride_d,
            H + offs_m[:, None] * K1,
            NW1,
            w_cols,
            mmask1,
            nmask,
            pid_n,
            tl.cdiv(N, BLOCK_N),
            0,
            K1,
            BLOCK_K,
            FUSED,
            HAS_DELTA,
            FUSED and HAS_DELTA,
            RNE,
            DOT_DTYPE,
            DOT_PRECISION,
        )
        y = acc
        if FUSED:
            y = acc * _rstd(ss, K1, eps)[:, None]  # [ROWS, BLOCK_N]
        elif SCALED:
            y = acc * tl.load(RSTD + offs_m * 2, mask=mmask, other=0.0)[:, None]
        if TWO:  # source 2: its own accumulator and lanes when scaled, else the same sum
            acc2 = tl.full([ROWS, BLOCK_N], 0.0, tl.float32) if SCALED else acc
            ss2 = tl.full([ROWS, BLOCK_K], 0.0, tl.float32)
            acc2, ss2 = _product(
                acc2,
                ss2,
                X2 + offs_m[:, None] * stride_x2,
                D,
                D,
                NW2,
                w_cols,
                mmask,
                nmask,
                pid_n,
                1,
                K1,
                K,
                BLOCK_K,
                FUSED,
                False,
                False,
                RNE,
                DOT_DTYPE,
                DOT_PRECISION,
            )
            if FUSED:
                y += acc2 * _rstd(ss2, K - K1, eps)[:, None]
            elif SCALED:
                y += acc2 * tl.load(RSTD + offs_m * 2 + 1, mask=mmask, other=0.0)[:, None]
            else:
                y = acc2

        # ---- epilogue: y = round(y + bias), stored, or reduced to this tile's argmax per row
        if HAS_BIAS:
            y += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if ARGMAX:
            y = tl.where(nmask[None, :], _round(y, DT, RNE), float("-inf"))
            best, at = tl.max(y, 1, return_indices=True, return_indices_tie_break_left=True)  # [ROWS]
            part = offs_m * tl.cdiv(N, BLOCK_N) + pid_n
            tl.store(PMAX + part, best, mask=mmask)
            tl.store(PIDX + part, pid_n * BLOCK_N + at, mask=mmask)
        elif GLU != 0:  # interleaved gate / up columns: the MLP's activation, as glu_reference rounds it
            g, u = tl.split(tl.reshape(_round(y, DT, RNE), (ROWS, BLOCK_N // 2, 2)))  # [ROWS, BLOCK_N / 2]
            if GLU == 1:  # silu
                g = g / (1.0 + tl.exp(-g))
            else:  # gelu, tanh approximation; tanh(c) = 1 - 2 / (exp(2c) + 1): +-1 at the extremes, no NaN
                c = 0.7978845608028654 * (g + 0.044715 * g * g * g)
                g = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * c) + 1.0))
            act = _round(g * u, DT, RNE)
            offs_a = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(
                Y + offs_m[:, None] * stride_y + offs_a[None, :],
                act.to(DT),
                mask=mmask[:, None] & (offs_a < N // 2)[None, :],
            )
        else:
            tl.store(
                Y + offs_m[:, None] * stride_y + offs_n[None, :],
                _round(y, DT, RNE).to(DT),
                mask=mmask[:, None] & nmask[None, :],
            )

    @triton.jit
    def _norm_source(
        X_row,
        D_row,
        H_row,
        NW,
        A_row,
        eps,
        x_live,
        K_S: tl.constexpr,
        K_P: tl.constexpr,
        BLOCK_K: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        RNE: tl.constexpr,
    ):
        """One row of one source [K_S] (K_P: a power of two >= K_S): a = round(h * norm_w) to A_row (h to
        H_row), -> its rstd [1]; with HAS_ZERO, x reads as zeros where x_live is false (a zeroed row; a
        row-wide flag keeps the loads vectorised). Every load comes before the first store, so all are in
        flight at once (a store ahead of a load holds the load behind it: one memory latency a chunk)."""
        DT = X_row.dtype.element_ty
        offs_k = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
        ss = tl.full([1, BLOCK_K], 0.0, tl.float32)
        for k0 in tl.static_range(0, K_S, BLOCK_K):  # the sum of squares: each lane's chunks in order
            kk = k0 + offs_k
            x = tl.load(X_row + kk, mask=(kk < K_S) & x_live if HAS_ZERO else kk < K_S, other=0.0)
            d = tl.load(D_row + kk, mask=kk < K_S, other=0.0) if HAS_DELTA else x
            h = _add_chunk(x, d, HAS_DELTA, RNE)
            ss += h * h
        kk = tl.arange(0, K_P)  # [K_P] h and a, elementwise over the row at once
        km = kk < K_S
        x = tl.load(X_row + kk, mask=km & x_live if HAS_ZERO else km, other=0.0)
        d = tl.load(D_row + kk, mask=km, other=0.0) if HAS_DELTA else x
        h = _add_chunk(x, d, HAS_DELTA, RNE)
        nw = tl.load(NW + kk, mask=km, other=0.0).to(tl.float32)
        if HAS_DELTA:
            tl.store(H_row + kk, h.to(DT), mask=km)
        tl.store(A_row + kk, _round(h * nw, DT, RNE).to(DT), mask=km)
        return _rstd(ss, K_S, eps)

    @triton.jit
    def _norm_rows_kernel(
        X1,
        stride_x1,
        IDX1,
        ZERO1,
        NW1,
        X2,
        stride_x2,
        NW2,
        D,
        stride_d,
        H,
        A,
        RSTD,
        eps,
        K: tl.constexpr,
        K1: tl.constexpr,
        K_P: tl.constexpr,  # a power of two >= each source's columns
        BLOCK_K: tl.constexpr,
        HAS_INDEX: tl.constexpr,
        HAS_ZERO1: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        RNE: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):
        """The norm of large calls, once per row (a program per row): h (stored with a delta), a =
        [round(h1 * nw1) | round(x2 * nw2)] -> A [M, K], each source's rstd -> RSTD [M, 2]; the product
        then reads A (PROLOGUE 2)."""
        await_prior(USE_GDC)
        m = tl.program_id(0)
        row1 = tl.load(IDX1 + m) if HAS_INDEX else m
        one = tl.arange(0, 1)
        live1 = tl.load(ZERO1 + m + one) == 0 if HAS_ZERO1 else False  # [1] (HAS_ZERO1) False: x1 reads as zeros
        r1 = _norm_source(X1 + row1 * stride_x1, D + m * stride_d, H + m * K1, NW1, A + m * K, eps, live1, K1, K_P,
                          BLOCK_K, HAS_ZERO1, HAS_DELTA, RNE)  # fmt: skip
        tl.store(RSTD + m * 2 + one, r1)
        if K1 < K:
            r2 = _norm_source(X2 + m * stride_x2, X2, X2, NW2, A + m * K + K1, eps, False, K - K1,
                              K_P, BLOCK_K, False, False, RNE)  # fmt: skip
            tl.store(RSTD + m * 2 + 1 + one, r2)

    @triton.jit
    def _argmax_reduce_kernel(
        PMAX, PIDX, OFFSETS, IDS, M, n_tiles, ROWS: tl.constexpr, BLOCK_T: tl.constexpr, HAS_OFFSETS: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """ids[m] = the index of row m's largest tile maximum, the lowest tile on ties (+ offsets[id]);
        ROWS rows per program. Exact: the result does not depend on how rows are grouped."""
        await_prior(USE_GDC)
        offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        t = tl.arange(0, BLOCK_T)
        mmask = offs_m < M
        part = offs_m[:, None] * n_tiles + t[None, :]  # [ROWS, BLOCK_T]
        best = tl.load(PMAX + part, mask=mmask[:, None] & (t < n_tiles)[None, :], other=float("-inf"))
        _, tile = tl.max(best, 1, return_indices=True, return_indices_tie_break_left=True)  # [ROWS]
        idx = tl.load(PIDX + offs_m * n_tiles + tile, mask=mmask, other=0).to(tl.int64)
        if HAS_OFFSETS:
            idx += tl.load(OFFSETS + idx, mask=mmask, other=0)
        tl.store(IDS + offs_m, idx, mask=mmask)


# ------------------------------------------------------------------------------------- launch
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


class GemvConfig(NamedTuple):
    rows: int  # rows of one program (M's bucket)
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def row_tile(m: int, n: int) -> int:
    """The row tile of a call of M rows and N columns: 16 up to 16 rows, and up to 64 on a narrow weight
    (N <= NARROW_N); 64 up to 64, then 128 for a wide weight (N > 8192) or past two 64-row tiles on one of
    N > NARROW_N; else 64 (more programs on the rest)."""
    if m <= ONE_TILE_M:
        return ROW_TILES[0] if n <= NARROW_N else next(r for r in ROW_TILES if r >= m)
    return ROW_TILES[-1] if n > 8192 or (n > NARROW_N and m > 2 * ONE_TILE_M) else ONE_TILE_M


def norm_first(m: int, k: int, glu: str | None = None) -> bool:
    """Whether a norm + product call normalises its rows in a pre-pass, then runs a plain product, rather
    than in the product's prologue: past FUSED_M rows, and at any M for K > FUSED_K (32 chunks at the 8B
    hidden size, whose activations the prologue loads a chunk ahead of their use) but a gated epilogue,
    which the pre-pass made slower; so did K = 576 (docs/performance.md has the timings)."""
    return m > FUSED_M or (k > FUSED_K and glu is None)


def gemv_config(
    n: int,
    k: int,
    m: int,
    *,
    prepass: bool = False,
    rows: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    itemsize: int = 2,
    act_tiles: int = 1,
) -> GemvConfig:
    """The launch configuration for an [N, K] weight and M rows (act_tiles: activation tiles read per
    chunk; prepass: the product after the norm's pre-pass, which takes the rules past FUSED_M rows at any
    M). Any choice here may follow M: none changes a row's arithmetic on the GPU (MMA k-steps in order over
    K, the norm's lanes of BLOCK_K columns), as the GPU tests check at every M. Any field can be
    overridden (tests, tuning).

    Up to FUSED_M rows a call streams its weight once: the widest column tile with at least _PROGRAMS
    programs, and few chunks in flight a program (_STAGES), so several programs share an SM and the
    last wave is short. Up to 64 rows, a narrow weight (N <= NARROW_N: SmolLM2's qkv, o and down) runs
    16-row tiles on the narrowest column tile that fits one wave (_SMS programs), others one row tile of
    64 with wider column tiles as N grows, both with as many chunks in flight as the shared-memory budget
    holds; past 64 rows, 64-row tiles the same way (chunks of 64 columns on SmolLM2's qkv and o shapes),
    or where `row_tile` gives 128 rows, 64- or 256-wide column tiles over chunks of 64 columns, up to
    _WIDE_STAGES in flight. The rules come from sweeps of rows, tile, warps, stages and chunk at the
    SmolLM2 and Llama-3.1-8B shapes (docs/performance.md)."""
    rows = rows or row_tile(m, n)
    bk = BLOCK_K
    few = m <= FUSED_M and not prepass
    if few:  # the widest tile that keeps the SMs busy, few chunks in flight
        bn = next((b for b in (128, 64, 32) if triton.cdiv(n, b) >= _PROGRAMS), 16)
        warps = 8 if bn >= 64 else 4
    elif m <= ONE_TILE_M and n <= NARROW_N and rows == ROW_TILES[0]:  # 16-row tiles: the most programs in a wave
        bn = next((b for b in (16, 32) if triton.cdiv(n, b) * triton.cdiv(m, rows) <= _SMS), 64)
        warps = 8 if bn >= 64 else 4
    elif m <= ONE_TILE_M:  # one row tile of 64: wider as N grows
        bn = 32 if n <= 4096 else 64 if n <= 8192 else 128
        warps = 8 if bn >= 64 else 4
    elif rows == ONE_TILE_M:  # several row tiles of 64: wider sooner, the activations re-read less
        bn = 32 if n <= 1024 else 64 if n <= 4096 else 128
        warps = 8 if bn == 128 else 4
        bk = WIDE_BLOCK_K if n <= 1024 and k <= 1024 else BLOCK_K
    else:  # row tiles of 128 over short chunks: the activations re-read less, more chunks in flight
        bn = 64 if n <= 8192 else 256
        warps = 8
        bk = WIDE_BLOCK_K
    bn, warps = block_n or bn, num_warps or warps
    in_flight = _STAGES.get(bn) if few else _WIDE_STAGES if bk == WIDE_BLOCK_K else None
    assert bn >= 16 and bn & (bn - 1) == 0, f"block_n must be a power of two >= 16 (tl.dot), got {bn}"
    assert rows in ROW_TILES, f"rows must be one of {ROW_TILES}, got {rows}"
    if num_stages is None:  # chunks in flight: as many as the shared-memory budget holds, or in_flight
        chunks = triton.cdiv(k, bk)
        per_stage = (bk * bn + act_tiles * rows * bk) * itemsize  # a weight chunk and the activation tiles
        fit = _SMEM_BUDGET // per_stage
        num_stages = 1 if chunks == 1 else max(2, min(chunks + 1, fit, in_flight or fit))
    return GemvConfig(rows, bn, bk, warps, num_stages)


def _as_rows(t: Tensor, k: int, name: str) -> Tensor:
    assert t.shape[-1] == k, f"{name}: last dim {t.shape[-1]}, expected {k}"
    t2 = t.reshape(-1, k)  # a view for 2-D inputs (any row stride) and contiguous leading dims
    assert t2.stride(-1) == 1 or k == 1, f"{name} must be contiguous along its last dim"
    return t2


def _launch(
    prologue: int,
    x1: Tensor,
    w: Tensor,
    bias: Tensor | None,
    *,
    m: int,
    k1: int,
    x2: Tensor | None = None,
    index1: Tensor | None = None,
    zero1: Tensor | None = None,
    delta: Tensor | None = None,
    norm_w1: Tensor | None = None,
    norm_w2: Tensor | None = None,
    eps: float = 0.0,
    argmax: bool = False,
    offsets: Tensor | None = None,
    glu: str | None = None,
    **tuning,
) -> tuple[Tensor | None, Tensor]:
    """Rows of the sources -> (h [M, K1] or None, y [M, N] or ids [M]). x1 [M, K1] (a table with index1),
    x2 [M, K - K1] (None: K = K1); zero1 [M] uint8: rows whose x1 reads as zeros."""
    n, k = w.shape
    assert w.stride(1) == 1, f"w must have a unit last stride, got strides {w.stride()}"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    x2 = x1 if x2 is None else x2  # one source: x2 is never read (TWO is False), only its dtype
    assert x1.dtype == x2.dtype, f"sources of different dtypes: {x1.dtype}, {x2.dtype}"
    dtype, device = x2.dtype, x2.device
    h = torch.empty(m, k1, dtype=dtype, device=device) if delta is not None else None
    interpret = _interpreting()
    rne = dtype == torch.bfloat16 and interpret
    gdc = pdl(device)
    d = delta if delta is not None else x2
    rstd = x2  # unused placeholder
    prepass = prologue == _RMSNORM and norm_first(m, k, glu)
    if prepass:  # normalise the rows once, then a plain product
        a = torch.empty(m, k, dtype=dtype, device=device)
        rstd = torch.empty(m, 2, dtype=torch.float32, device=device)
        _norm_rows_kernel[(m,)](
            x1, x1.stride(0), index1 if index1 is not None else x1, zero1 if zero1 is not None else x1, norm_w1,
            x2, x2.stride(0), norm_w2 if norm_w2 is not None else norm_w1, d, d.stride(0),
            h if h is not None else x2, a, rstd, eps,
            K=k, K1=k1, K_P=triton.next_power_of_2(max(k1, k - k1)), BLOCK_K=BLOCK_K, HAS_INDEX=index1 is not None,
            HAS_ZERO1=zero1 is not None, HAS_DELTA=delta is not None, RNE=rne, USE_GDC=gdc,
            num_warps=4,
            enable_fp_fusion=False,
            launch_pdl=gdc,
        )  # fmt: skip
        prologue, x1, x2, index1, zero1, delta, d = 2, a[:, :k1], (a[:, k1:] if k1 < k else a), None, None, None, a
    act_tiles = 1 + (delta is not None)  # activation tiles loaded per K chunk
    cfg = gemv_config(n, k, m, prepass=prepass, itemsize=dtype.itemsize, act_tiles=act_tiles, **tuning)
    if interpret:  # its dot sums a whole chunk at once (numpy), the GPU's in MMA k-steps: BLOCK_K at every M
        cfg = cfg._replace(block_k=BLOCK_K)
    n_tiles = triton.cdiv(n, cfg.block_n)
    if argmax:
        assert offsets is None or (offsets.dtype == torch.int64 and offsets.is_contiguous())
        out = torch.empty(m, dtype=torch.int64, device=device)
        pmax = torch.empty(m, n_tiles, dtype=torch.float32, device=device)
        pidx = torch.empty(m, n_tiles, dtype=torch.int32, device=device)
        y = pmax  # unused placeholder
    else:
        assert glu is None or n % 2 == 0, "glu: interleaved [gate, up] rows, an even N"
        out = y = torch.empty(m, n if glu is None else n // 2, dtype=dtype, device=device)
        pmax = pidx = y  # unused placeholders
    if m == 0:
        return h, out
    dot_dtype = (
        tl.float32 if interpret or dtype == torch.float32 else (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16)
    )
    _gemv_kernel[(n_tiles * triton.cdiv(m, cfg.rows),)](
        x1,
        x1.stride(0),
        index1 if index1 is not None else x1,
        zero1 if zero1 is not None else x1,
        norm_w1 if norm_w1 is not None else x1,
        x2,
        x2.stride(0),
        norm_w2 if norm_w2 is not None else x2,
        d,
        d.stride(0),
        h if h is not None else x2,
        rstd,
        w,
        w.stride(0),
        bias if bias is not None else w,
        y,
        y.stride(0),
        pmax,
        pidx,
        m,
        n,
        eps,
        K=k,
        K1=k1,
        ROWS=cfg.rows,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PROLOGUE=prologue,
        HAS_INDEX=index1 is not None,
        HAS_ZERO1=zero1 is not None,
        HAS_DELTA=delta is not None,
        HAS_BIAS=bias is not None,
        ARGMAX=argmax,
        GLU=0 if glu is None else GLU_EPILOGUES[glu],
        RNE=rne,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",  # (tf32: ignored for 16-bit operands)
        USE_GDC=gdc,
        PF_LINES=triton.next_power_of_2(triton.cdiv(min(k, PREFETCH_K) * w.element_size(), 128)) if gdc else 1,
        PF_STEP=128 // w.element_size(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=False,  # every multiply and add rounded as written, in every kernel (batch invariance)
        launch_pdl=gdc,
    )
    if argmax:
        block_t = triton.next_power_of_2(n_tiles)
        rows_r = max(1, min(16, 4096 // block_t))  # up to 4096 partials per program
        _argmax_reduce_kernel[(triton.cdiv(m, rows_r),)](
            pmax,
            pidx,
            offsets if offsets is not None else out,
            out,
            m,
            n_tiles,
            ROWS=rows_r,
            BLOCK_T=block_t,
            HAS_OFFSETS=offsets is not None,
            USE_GDC=gdc,
            num_warps=4,
            launch_pdl=gdc,
        )
    return h, out


def _shape_out(y: Tensor, lead: torch.Size, argmax: bool) -> Tensor:
    return y.view(*lead) if argmax else y.view(*lead, y.shape[-1])


def gemv(
    x: Tensor, w: Tensor, bias: Tensor | None = None, *, argmax: bool = False, offsets: Tensor | None = None, **tuning
) -> Tensor:
    """y = x @ w^T (+ bias): x [..., K], w [N, K] -> y [..., N] in x's dtype; with argmax, the ids [...]
    (int64) of round(y)'s maxima, the first on ties (+ offsets[ids]), instead. tuning: `gemv_config`'s
    overrides (block_n, block_k, num_warps, num_stages) and rows (the row tile), for tests and tuning."""
    if triton is None:
        y = gemv_reference(x, w, bias)
        return argmax_reference(y, offsets) if argmax else y
    k = w.shape[1]
    x2 = _as_rows(x, k, "x")
    _, y = _launch(_PLAIN, x2, w, bias, m=x2.shape[0], k1=k, argmax=argmax, offsets=offsets, **tuning)
    return _shape_out(y, x.shape[:-1], argmax)


def add_rmsnorm_gemv(
    x: Tensor,
    delta: Tensor | None,
    norm_w: Tensor,
    eps: float,
    w: Tensor,
    bias: Tensor | None = None,
    *,
    argmax: bool = False,
    offsets: Tensor | None = None,
    glu: str | None = None,
    **tuning,
) -> tuple[Tensor, Tensor]:
    """(h, y): h = x + delta (x when delta is None), y = rmsnorm(h; norm_w) @ w^T (+ bias);
    x, delta [..., K], norm_w [K], w [N, K] -> h [..., K], y [..., N] (argmax, tuning: see gemv).
    glu (silu: SwiGLU, gelu_pytorch_tanh: GeGLU): w holds interleaved gate / up rows (`interleave_gate_up`):
    y = act(gate) * up [..., N / 2], the MLP's activation, rounded as glu_reference rounds it."""
    if glu is not None and glu not in GLU_EPILOGUES:
        raise ValueError(f"glu={glu!r} is not a gated epilogue; valid: {sorted(GLU_EPILOGUES)}")
    if triton is None:
        h, y = add_rmsnorm_gemv_reference(x, delta, norm_w, eps, w, bias)
        if glu is not None:
            y = glu_reference(y, glu)
        return h, (argmax_reference(y, offsets) if argmax else y)
    k = w.shape[1]
    x2 = _as_rows(x, k, "x")
    d2 = None
    if delta is not None:
        assert delta.shape == x.shape, f"delta {tuple(delta.shape)} != x {tuple(x.shape)}"
        d2 = _as_rows(delta, k, "delta")
    assert norm_w.shape == (k,) and norm_w.is_contiguous()
    h, y = _launch(
        _RMSNORM,
        x2,
        w,
        bias,
        m=x2.shape[0],
        k1=k,
        delta=d2,
        norm_w1=norm_w,
        eps=float(eps),
        argmax=argmax,
        offsets=offsets,
        glu=glu,
        **tuning,
    )
    return (x if h is None else h.view(x.shape)), _shape_out(y, x.shape[:-1], argmax)


def cat_rmsnorm_gemv(
    x1: Tensor,
    x2: Tensor,
    norm_w1: Tensor | None,
    norm_w2: Tensor | None,
    eps: float,
    w: Tensor,
    bias: Tensor | None = None,
    *,
    index1: Tensor | None = None,
    norm: bool = True,
    zero1: Tensor | None = None,
    argmax: bool = False,
    offsets: Tensor | None = None,
    **tuning,
) -> Tensor:
    """y = a @ w^T (+ bias), a = [rmsnorm(x1_row; norm_w1), rmsnorm(x2_row; norm_w2)] (each half with
    its own rstd; the plain concatenation with norm=False): x2 [..., K2], w [N, K1 + K2] -> y [..., N]
    (argmax, tuning: see gemv). x1 [..., K1] as x2, or with index1 (int64, x2's leading shape) a table
    [V, K1] whose row index1[m] is row m's: the embedding lookup fused into the prologue. zero1 (bool, x2's
    leading shape): where True, row m's x1 reads as zeros (public MTP layers' token embedding at position 0).
    EAGLE3's qkv input, MTP's eh_proj input; EAGLE-1's fc input with norm=False."""
    if triton is None:
        y = cat_rmsnorm_gemv_reference(x1, x2, norm_w1, norm_w2, eps, w, bias, index1=index1, norm=norm, zero1=zero1)
        return argmax_reference(y, offsets) if argmax else y
    k1, k2 = x1.shape[-1], x2.shape[-1]
    assert w.shape[1] == k1 + k2, f"w: {w.shape[1]} columns, expected K1 + K2 = {k1} + {k2}"
    lead = x2.shape[:-1]
    x2r = _as_rows(x2, k2, "x2")
    if index1 is None:
        assert x1.shape[:-1] == lead, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ in leading dims"
        x1r, idx = _as_rows(x1, k1, "x1"), None
    else:
        assert x1.dim() == 2 and x1.stride(1) == 1, "x1 must be a table [V, K1] with a unit last stride"
        assert index1.shape == lead and index1.dtype == torch.int64, f"index1 must be int64 of shape {tuple(lead)}"
        x1r, idx = x1, index1.reshape(-1).contiguous()
    z1 = None
    if zero1 is not None:
        assert zero1.shape == lead and zero1.dtype == torch.bool, f"zero1 must be bool of shape {tuple(lead)}"
        z1 = zero1.reshape(-1).contiguous().view(torch.uint8)
    if norm:
        assert norm_w1 is not None and norm_w1.shape == (k1,) and norm_w1.is_contiguous()
        assert norm_w2 is not None and norm_w2.shape == (k2,) and norm_w2.is_contiguous()
    _, y = _launch(
        _RMSNORM if norm else _PLAIN,
        x1r,
        w,
        bias,
        m=x2r.shape[0],
        k1=k1,
        x2=x2r,
        index1=idx,
        zero1=z1,
        norm_w1=norm_w1 if norm else None,
        norm_w2=norm_w2 if norm else None,
        eps=float(eps),
        argmax=argmax,
        offsets=offsets,
        **tuning,
    )
    return _shape_out(y, lead, argmax)
