"""Batch-invariant small-M matrix products for decode / verify / draft steps, with the elementwise ops
between them fused into their prologues and the greedy argmax into their epilogue.

    gemv(x, w, bias=None) -> y                                y = x @ w^T (+ bias)
    add_rmsnorm_gemv(x, delta, norm_w, eps, w, bias=None)     h = x + delta (x when delta is None);
        -> (h, y)                                             y = (norm_w * rmsnorm(h)) @ w^T (+ bias)
        swiglu=True: w's rows are interleaved gate / up (interleave_gate_up); y = silu(gate) * up [M, N/2]
    cat_rmsnorm_gemv(x1, x2, norm_w1, norm_w2, eps, w,        a = [norm_w1 * rmsnorm(x1_row), norm_w2 * rmsnorm(x2_row)]
                     bias=None, *, index1=None, norm=True)    ([x1_row, x2_row] with norm=False);
        -> y                                                  y = a @ w^T (+ bias); x1_row = x1[index1[m]]
                                                              with index1 (an embedding lookup fused in)
    argmax=True (gemv, add_rmsnorm_gemv, cat_rmsnorm_gemv): return ids = argmax_n round(y) (+ offsets[ids])
        in place of y, without writing y: greedy sampling of an lm_head (offsets: EAGLE3's d2t map).

Layouts (nn.Linear's, y = x @ w^T):
    x, delta, h  [M, K]         M = rows (batch x tokens), any M; any row stride, unit last stride.
                                Leading dims are flattened: [b, t, K] in gives [b, t, N] (ids [b, t]) out.
    x1, x2       [M, K1], [M, K2]   K = K1 + K2; with index1 ([M] int64), x1 is a table [V, K1]
    w            [N, K]         unit last stride, any row stride; norm_w [K] (norm_w1 [K1], norm_w2 [K2]); bias [N]
    y            [M, N]         x's dtype. ids [M] int64. Fresh tensors every call (graph-capture safe);
                                with delta=None, h is x itself, as in kernels.fused.add_rmsnorm.

Why. At decode / verify / draft sizes (M = 1..48 here) a projection of SmolLM2-135M (hidden 576,
intermediate 1536, bf16) or of its EAGLE3 head is latency-bound: its weight is 0.6-3.5 MB (lm_head
56 MB), and the call should cost about one DRAM round trip plus a launch. A layer is four such calls
and no elementwise launches:
    [add + rmsnorm + qkv] -> rope/cache -> attention -> [o_proj] -> [add + rmsnorm + gate_up + silu*up] -> [down]
(a sublayer's residual add happens in the next norm, as DecoderLayer.pre/post carry it; SwiGLU is the
gate/up kernel's epilogue, its gate and up rows interleaved so that a tile holds matching columns),
and the draft's first projection takes [embed(token) | hidden] through cat_rmsnorm_gemv.

Design. One kernel, `_gemv_kernel`, the prologue picked by constexprs, over a grid
(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)); program (j, i) owns y[i-th 16 rows, j-th BLOCK_N columns]:
  * the weight w^T [K, BLOCK_N] is walked in BLOCK_K chunks (128-256), in order, and each chunk is
    one `acc = tl.dot(a, w_chunk, acc)` (tensor cores, fp32 accumulation [BLOCK_M, BLOCK_N]). The
    weight loads feed the dot directly, so Triton's pipeliner keeps num_stages - 1 chunks in flight;
    the defaults give num_stages = chunks + 1 (within a shared-memory budget), so for K <= 2048 the
    program's whole weight share is requested at once. With K <= BLOCK_K (one chunk) the weight tile
    is loaded first of all, before the prologue's first pass over the activations.
  * the prologue builds the activation tile a [BLOCK_M, BLOCK_K] for each chunk in registers from up
    to two sources (columns [0, K1) from x1, [K1, K) from x2): plain loads, or RMSNorm (pass 1 over the
    row: h = x + delta, stored by the programs of column tile 0, and the sum of squares -> rstd per
    source; pass 2, in the K loop, re-reads h (L1 / L2 hits) and forms round(norm_w * round(h * rstd))).
    Every column tile recomputes the norms of its rows: K elements from L2 that overlap the weight's
    DRAM latency, far cheaper than another launch.
  * the epilogue adds the bias and rounds, then stores y; or (swiglu) splits the tile's interleaved
    columns into gate and up and stores round(silu(gate) * up), half as wide; or (argmax) the max of
    the rounded row over the tile and its lowest index into fp32 / int32 partials [M, n_tiles];
    `_argmax_reduce_kernel` takes each row's max over tiles, the lowest tile on ties, so ties go to the
    lowest index as in torch.argmax, and adds offsets[id].
  * (A SiLU * up *prologue* for the down projection was tried: its activation loads, which feed math
    before the dot, are not pipelined, and it cost 20-28 us at K = 1536 against 3.4 us for a per-row
    GEMV; the epilogue on gate / up costs nothing measurable.)
No split-K, no atomics: every output is a fixed sequence of tl.dot calls over K.

Batch invariance. A row's outputs (y, h, ids) are bitwise the same whatever M is and wherever the row
sits (alone, one of 6 verify tokens, row 37 of 192): BLOCK_M is 16 always, and BLOCK_N, BLOCK_K,
num_warps and num_stages depend on (N, K, the SM count) only (`gemv_config`), so every call of a weight
runs one binary (M is `do_not_specialize`d, so M = 1 is no special case) whose tiles, layouts and
reduction orders do not depend on M; a tile's rows never mix (a row of tl.dot's output reads only its
own row of a; padding rows are masked zeros), and the chunks over K are summed in one fixed order.
(Triton also specialises on 16-byte alignment of pointers and strides; rows of fresh tensors with
K * itemsize % 16 == 0, as all of SmolLM2's are, always get the same specialisation.) This is what
lets greedy speculative decoding in bf16 match plain decoding token for token at any batch size.

Block sizes (`gemv_config`, bf16), from N alone, as measured on an H100 (docs/performance.md):
    N <= 1024    qkv 960x576, o 576x576, down 576x1536, draft qkv 960x1152     32 x 256, 4 warps
    N <= 4096    gate_up 3072x576, draft gate_up 1536x576                      64 x 128, 8 warps
    larger       lm_head 49152x576, draft lm_head 10240x576                    64 x 64, 4 warps, 3 stages
num_stages = chunks + 1 (every chunk in flight) where the buffers fit in _SMEM_BUDGET (the pipeliner
buffers every load in the K loop: the weight chunk and the prologue's activation tiles). Each is
overridable per call (block_n=, block_k=, num_warps=, num_stages=) for tuning.

Rounding follows the `*_reference` functions below, which compose kernels.fused's references:
h = round(x + delta) in fp32; n = round(round(h * rsqrt(mean(h^2) + eps)) * norm_w);
y = round(sum_k a_k w_k + bias) with an fp32 sum; swiglu: round(silu(g) * u) of the rounded y; argmax
over round(y). Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) truncates fp32 -> bf16 where the GPU
rounds to nearest even; under it the kernel rounds bf16 by hand, and multiplies its (already rounded)
dot operands in fp32, so the CPU tests check the GPU's roundings.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from kernels.fused import add_rmsnorm_reference, silu_mul_reference
from kernels.runtime import triton

if triton is not None:
    import triton.language as tl

BLOCK_M = 16  # rows per program, whatever M is (tl.dot's minimum); more rows take more row tiles
MAX_ROWS = BLOCK_M  # rows of one row tile: not a limit on M (any M works), kept for importers
_SMEM_BUDGET = 192 * 1024  # bytes of pipelined load buffers a program may hold (H100 / H200: 227 KB in all)
_PLAIN, _RMSNORM = 0, 1  # prologues


# ------------------------------------------------------------------------------------- references
def gemv_reference(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    y = x.float() @ w.float().t()  # [M, N], fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def add_rmsnorm_gemv_reference(
    x: Tensor, delta: Tensor | None, norm_w: Tensor, eps: float, w: Tensor, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    h, n = add_rmsnorm_reference(x, delta, norm_w, eps)
    return h, gemv_reference(n.to(x.dtype), w, bias)


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
) -> Tensor:
    a1 = x1 if index1 is None else x1[index1]  # [..., K1]
    a2 = x2  # [..., K2]
    if norm:
        a1 = add_rmsnorm_reference(a1, None, norm_w1, eps)[1].to(x2.dtype)
        a2 = add_rmsnorm_reference(a2, None, norm_w2, eps)[1].to(x2.dtype)
    return gemv_reference(torch.cat([a1, a2], -1), w, bias)


def interleave_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """[I, ...] gate and up rows (weights or biases) -> [2I, ...] in the order g0, u0, g1, u1, ...: the
    layout whose output tile holds matching gate / up columns (add_rmsnorm_gemv's swiglu epilogue)."""
    return torch.stack([gate, up], 1).reshape(2 * gate.shape[0], *gate.shape[1:])


def swiglu_reference(gu: Tensor) -> Tensor:
    """Interleaved [..., 2I] (g0, u0, g1, u1, ...) -> round(silu(g) * u) [..., I], as silu_mul_reference."""
    return silu_mul_reference(torch.cat([gu[..., 0::2], gu[..., 1::2]], -1))


def argmax_reference(y: Tensor, offsets: Tensor | None = None) -> Tensor:
    """The greedy token of logits y [..., N] (the first index of the maximum), mapped by offsets."""
    ids = y.argmax(-1)
    return ids if offsets is None else ids + offsets[ids]


# ------------------------------------------------------------------------------------- kernels
if triton is not None:

    @triton.jit
    def _round(x, DT: tl.constexpr, RNE: tl.constexpr):
        """fp32 -> fp32 holding the nearest DT value (a rounding point of the references). RNE: round to
        bf16 by hand, to nearest even (under TRITON_INTERPRET=1, whose fp32 -> bf16 cast truncates; the
        GPU's cvt.rn rounds); the cast after it is then exact."""
        if RNE:
            bits = x.to(tl.uint32, bitcast=True)
            half = tl.add((bits >> 16) & 1, 0x7FFF, sanitize_overflow=False)  # half an ulp, + 1 if odd: ties to even
            bits = tl.add(bits, half, sanitize_overflow=False) & 0xFFFF0000  # (no overflow check: slow to interpret)
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _rstd(
        x_rows,
        d_rows,
        H,
        offs_m,
        row_mask,
        n_cols,
        eps,
        store_h,
        DT: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        RNE: tl.constexpr,
    ):
        """RMSNorm pass 1 over a source's rows [BLOCK_M, 1] (pointers): 1 / sqrt(mean(h^2) + eps) [BLOCK_M],
        h = round(x + delta) (x without a delta); with a delta it also stores h (where store_h)."""
        offs_k = tl.arange(0, BLOCK_K)
        ss = tl.full([BLOCK_M, BLOCK_K], 0.0, tl.float32)  # (tl.full: tl.zeros is slow to interpret)
        for k0 in range(0, n_cols, BLOCK_K):
            cols = k0 + offs_k
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            h = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_DELTA:
                h = _round(h + tl.load(d_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32), DT, RNE)
                if store_h:
                    tl.store(H + offs_m[:, None] * n_cols + cols[None, :], h.to(DT), mask=mask)
            ss += h * h
        return 1.0 / tl.sqrt(tl.sum(ss, 1) / n_cols + eps)  # one fixed reduction order per row

    @triton.jit(do_not_specialize=["M"])  # M = 1 runs the same binary as any other M
    def _gemv_kernel(
        X1,
        stride_x1,
        IDX1,
        NW1,  # source 1: columns [0, K1); x1[IDX1[m]] if HAS_INDEX
        X2,
        stride_x2,
        NW2,  # source 2: columns [K1, K)
        D,
        stride_d,
        H,  # delta [M, K1], h out [M, K1] contiguous (HAS_DELTA)
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
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PROLOGUE: tl.constexpr,  # 0: plain, 1: RMSNorm per source
        HAS_INDEX: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ARGMAX: tl.constexpr,
        SWIGLU: tl.constexpr,  # epilogue: y holds [g0, u0, g1, u1, ...]; store round(silu(g) * u) [M, N / 2]
        RNE: tl.constexpr,  # round fp32 -> bf16 by hand (the interpreter, bf16 only)
        DOT_DTYPE: tl.constexpr,  # the dot's operand type: the activations' (fp32 under the interpreter)
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands: exact products, no TF32
    ):
        DT = X2.dtype.element_ty  # the activations' dtype: every rounding point rounds to it
        TWO: tl.constexpr = K1 < K  # columns [K1, K) come from x2
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of this program
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
        offs_k = tl.arange(0, BLOCK_K)
        mmask, nmask = offs_m < M, offs_n < N
        w_cols = W + offs_n[None, :] * stride_w  # [1, BLOCK_N]: the columns of w^T
        if K <= BLOCK_K:
            # One chunk: the whole weight share, requested before anything touches the activations.
            w_all = tl.load(
                w_cols + offs_k[:, None],
                mask=(offs_k < K)[:, None] & nmask[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )  # [BLOCK_K, BLOCK_N]

        rows1 = offs_m
        if HAS_INDEX:
            rows1 = tl.load(IDX1 + offs_m, mask=mmask, other=0)  # [BLOCK_M] table rows (an embedding lookup)
        x1_rows = X1 + rows1[:, None] * stride_x1  # [BLOCK_M, 1]
        x2_rows = X2 + offs_m[:, None] * stride_x2
        d_rows = D + offs_m[:, None] * stride_d
        if PROLOGUE == 1:  # pass 1: each source's rstd [BLOCK_M] (and h, stored by column tile 0)
            rstd1 = _rstd(x1_rows, d_rows, H, offs_m, mmask, K1, eps, pid_n == 0, DT, HAS_DELTA, BLOCK_M, BLOCK_K, RNE)
            if TWO:
                rstd2 = _rstd(x2_rows, d_rows, H, offs_m, mmask, K - K1, eps, False, DT, False, BLOCK_M, BLOCK_K, RNE)

        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):  # a fixed order over K; one trip when K <= BLOCK_K
            # ---- prologue: the activation chunk a [BLOCK_M, BLOCK_K] of DT values, columns k of [x1 | x2]
            k = k0 + offs_k  # [BLOCK_K]
            k2 = k - K1  # x2's columns
            in1 = (k < K1)[None, :]  # [1, BLOCK_K]
            m1 = mmask[:, None] & in1  # [BLOCK_M, BLOCK_K]
            m2 = mmask[:, None] & ((k2 >= 0) & (k2 < K - K1))[None, :]
            if PROLOGUE == 0:  # as is
                a = tl.load(x1_rows + k[None, :], mask=m1, other=0.0)
                if TWO:
                    a = tl.where(in1, a, tl.load(x2_rows + k2[None, :], mask=m2, other=0.0))
            else:  # RMSNorm: round(norm_w * round(h * rstd)) per source; h read again (L1 / L2 hits)
                h = tl.load(x1_rows + k[None, :], mask=m1, other=0.0).to(tl.float32)
                if HAS_DELTA:
                    h = _round(h + tl.load(d_rows + k[None, :], mask=m1, other=0.0).to(tl.float32), DT, RNE)
                nw = tl.load(NW1 + k, mask=k < K1, other=0.0).to(tl.float32)  # [BLOCK_K]
                a = _round(_round(h * rstd1[:, None], DT, RNE) * nw[None, :], DT, RNE)
                if TWO:
                    h = tl.load(x2_rows + k2[None, :], mask=m2, other=0.0).to(tl.float32)
                    nw = tl.load(NW2 + k2, mask=(k2 >= 0) & (k2 < K - K1), other=0.0).to(tl.float32)
                    a = tl.where(in1, a, _round(_round(h * rstd2[:, None], DT, RNE) * nw[None, :], DT, RNE))
            # ---- the product: acc += a @ w^T[k, tile], fp32 accumulation
            if K <= BLOCK_K:
                w = w_all
            else:
                w = tl.load(
                    w_cols + k[:, None],
                    mask=(k < K)[:, None] & nmask[None, :],
                    other=0.0,
                    eviction_policy="evict_first",
                )  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)

        # ---- epilogue: y = round(acc + bias), stored, or reduced to this tile's argmax per row
        y = acc  # [BLOCK_M, BLOCK_N]
        if HAS_BIAS:
            y += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if ARGMAX:
            y = tl.where(nmask[None, :], _round(y, DT, RNE), float("-inf"))
            best, at = tl.max(y, 1, return_indices=True, return_indices_tie_break_left=True)  # [BLOCK_M]
            part = offs_m * tl.num_programs(0) + pid_n
            tl.store(PMAX + part, best, mask=mmask)
            tl.store(PIDX + part, pid_n * BLOCK_N + at, mask=mmask)
        elif SWIGLU:  # interleaved gate / up columns: the MLP's activation, as silu_mul_reference rounds it
            g, u = tl.split(tl.reshape(_round(y, DT, RNE), (BLOCK_M, BLOCK_N // 2, 2)))  # [BLOCK_M, BLOCK_N / 2]
            act = _round(g / (1.0 + tl.exp(-g)) * u, DT, RNE)
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
    def _argmax_reduce_kernel(
        PMAX, PIDX, OFFSETS, IDS, M, n_tiles, ROWS: tl.constexpr, BLOCK_T: tl.constexpr, HAS_OFFSETS: tl.constexpr
    ):
        """ids[m] = the index of row m's largest tile maximum, the lowest tile on ties (+ offsets[id]);
        ROWS rows per program. Exact: the result does not depend on how rows are grouped."""
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
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemv_config(
    n: int,
    k: int,
    device: torch.device,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    itemsize: int = 2,
    act_tiles: int = 2,
) -> GemvConfig:
    """The launch configuration for an [N, K] weight: a function of N, K and the prologue's loads
    (act_tiles: [BLOCK_M, BLOCK_K] activation tiles read per chunk), never of M (which keeps a row's
    result independent of the batch it is computed in). Any field can be overridden.

    By N (measured on an H100 at M = 1..192, SmolLM2-135M and its EAGLE3 head, docs/performance.md):
    N <= 1024 (q/k/v, o, down) 32-wide tiles in 256-deep chunks, 4 warps, every chunk in flight;
    N <= 4096 (gate/up) 64 x 128, 8 warps; larger N (the lm_heads: hundreds of tiles, bandwidth-bound)
    64 x 64, 4 warps, 3 stages."""
    wide = n > 4096
    bn = block_n or (32 if n <= 1024 else 64)
    bk = block_k or min(256 if n <= 1024 else 128 if not wide else 64, max(16, triton.next_power_of_2(k)))
    for name, v in (("block_n", bn), ("block_k", bk)):
        assert v >= 16 and v & (v - 1) == 0, f"{name} must be a power of two >= 16 (tl.dot), got {v}"
    if num_stages is None:  # every chunk in flight at once, within the shared-memory budget
        chunks = triton.cdiv(k, bk)
        # the pipeliner keeps num_stages - 1 buffers of each load in the loop: a weight chunk, the activations
        per_stage = (bk * bn + act_tiles * BLOCK_M * bk) * itemsize
        num_stages = 1 if chunks == 1 else 1 + max(1, min(chunks, _SMEM_BUDGET // per_stage))
        if wide:
            num_stages = min(num_stages, 3)
    warps = num_warps or (8 if 1024 < n <= 4096 else 4)
    return GemvConfig(bn, bk, warps, num_stages)


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
    delta: Tensor | None = None,
    norm_w1: Tensor | None = None,
    norm_w2: Tensor | None = None,
    eps: float = 0.0,
    argmax: bool = False,
    offsets: Tensor | None = None,
    swiglu: bool = False,
    **tuning,
) -> tuple[Tensor | None, Tensor]:
    """Rows of the sources -> (h [M, K1] or None, y [M, N] or ids [M]). x1 [M, K1] (a table with index1),
    x2 [M, K - K1] (None: K = K1)."""
    n, k = w.shape
    assert w.stride(1) == 1, f"w must have a unit last stride, got strides {w.stride()}"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    x2 = x1 if x2 is None else x2  # one source: x2 is never read (TWO is False), only its dtype
    assert x1.dtype == x2.dtype, f"sources of different dtypes: {x1.dtype}, {x2.dtype}"
    dtype, device = x2.dtype, x2.device
    h = torch.empty(m, k1, dtype=dtype, device=device) if delta is not None else None
    act_tiles = 1 + (delta is not None) + (k1 < k)  # activation tiles loaded per K chunk
    cfg = gemv_config(n, k, device, itemsize=dtype.itemsize, act_tiles=act_tiles, **tuning)
    n_tiles = triton.cdiv(n, cfg.block_n)
    if argmax:
        assert offsets is None or (offsets.dtype == torch.int64 and offsets.is_contiguous())
        out = torch.empty(m, dtype=torch.int64, device=device)
        pmax = torch.empty(m, n_tiles, dtype=torch.float32, device=device)
        pidx = torch.empty(m, n_tiles, dtype=torch.int32, device=device)
        y = pmax  # unused placeholder
    else:
        assert not swiglu or n % 2 == 0, "swiglu: interleaved [gate, up] rows, an even N"
        out = y = torch.empty(m, n // 2 if swiglu else n, dtype=dtype, device=device)
        pmax = pidx = y  # unused placeholders
    if m == 0:
        return h, out
    interpret = _interpreting()
    dot_dtype = (
        tl.float32 if interpret or dtype == torch.float32 else (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16)
    )
    d = delta if delta is not None else x2
    _gemv_kernel[(n_tiles, triton.cdiv(m, BLOCK_M))](
        x1,
        x1.stride(0),
        index1 if index1 is not None else x1,
        norm_w1 if norm_w1 is not None else x1,
        x2,
        x2.stride(0),
        norm_w2 if norm_w2 is not None else x2,
        d,
        d.stride(0),
        h if h is not None else x2,
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
        BLOCK_M=BLOCK_M,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PROLOGUE=prologue,
        HAS_INDEX=index1 is not None,
        HAS_DELTA=delta is not None,
        HAS_BIAS=bias is not None,
        ARGMAX=argmax,
        SWIGLU=swiglu,
        RNE=dtype == torch.bfloat16 and interpret,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",  # (tf32: ignored for 16-bit operands)
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if argmax:
        block_t = triton.next_power_of_2(n_tiles)
        rows = max(1, min(BLOCK_M, 4096 // block_t))  # up to 4096 partials per program
        _argmax_reduce_kernel[(triton.cdiv(m, rows),)](
            pmax,
            pidx,
            offsets if offsets is not None else out,
            out,
            m,
            n_tiles,
            ROWS=rows,
            BLOCK_T=block_t,
            HAS_OFFSETS=offsets is not None,
            num_warps=4,
        )
    return h, out


def _shape_out(y: Tensor, lead: torch.Size, argmax: bool) -> Tensor:
    return y.view(*lead) if argmax else y.view(*lead, y.shape[-1])


def gemv(
    x: Tensor, w: Tensor, bias: Tensor | None = None, *, argmax: bool = False, offsets: Tensor | None = None, **tuning
) -> Tensor:
    """y = x @ w^T (+ bias): x [..., K], w [N, K] -> y [..., N] in x's dtype; with argmax, the ids [...]
    (int64) of round(y)'s maxima, the first on ties (+ offsets[ids]), instead. tuning: `gemv_config`'s
    overrides (block_n, block_k, num_warps, num_stages), for tests and tuning."""
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
    swiglu: bool = False,
    **tuning,
) -> tuple[Tensor, Tensor]:
    """(h, y): h = x + delta (x when delta is None), y = (norm_w * rmsnorm(h)) @ w^T (+ bias);
    x, delta [..., K], norm_w [K], w [N, K] -> h [..., K], y [..., N] (argmax, tuning: see gemv).
    swiglu: w holds interleaved gate / up rows (`interleave_gate_up`): y = silu(gate) * up [..., N / 2],
    the MLP's activation, rounded as silu_mul_reference rounds it, for the down projection."""
    if triton is None:
        h, y = add_rmsnorm_gemv_reference(x, delta, norm_w, eps, w, bias)
        if swiglu:
            y = swiglu_reference(y)
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
        swiglu=swiglu,
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
    argmax: bool = False,
    offsets: Tensor | None = None,
    **tuning,
) -> Tensor:
    """y = a @ w^T (+ bias), a = [norm_w1 * rmsnorm(x1_row), norm_w2 * rmsnorm(x2_row)] (each half with
    its own rstd; the plain concatenation with norm=False): x2 [..., K2], w [N, K1 + K2] -> y [..., N]
    (argmax, tuning: see gemv). x1 [..., K1] as x2, or with index1 (int64, x2's leading shape) a table
    [V, K1] whose row index1[m] is row m's: the embedding lookup fused into the prologue.
    EAGLE3's qkv input, MTP's eh_proj input; EAGLE-1's fc input with norm=False."""
    if triton is None:
        y = cat_rmsnorm_gemv_reference(x1, x2, norm_w1, norm_w2, eps, w, bias, index1=index1, norm=norm)
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
        norm_w1=norm_w1 if norm else None,
        norm_w2=norm_w2 if norm else None,
        eps=float(eps),
        argmax=argmax,
        offsets=offsets,
        **tuning,
    )
    return _shape_out(y, lead, argmax)
