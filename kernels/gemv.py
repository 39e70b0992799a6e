"""Small-M GEMV kernels for the decode step, with the elementwise ops between them fused into their prologues.

    gemv(x, w, bias=None) -> y                              y = x @ w^T (+ bias)
    add_rmsnorm_gemv(x, delta, norm_w, eps, w, bias=None)   h = x + delta; n = norm_w * rmsnorm(h);
        -> (h, y)                                           y = n @ w^T (+ bias)
    silu_mul_gemv(gu, w, bias=None) -> y                    a = silu(gu[:, :I]) * gu[:, I:];
                                                            y = a @ w^T (+ bias)

Layouts (nn.Linear's, y = x @ w^T):
    x, delta, h  [M, K]      M = batch x tokens <= MAX_ROWS (16); any row stride, unit last stride.
                             Leading dims are flattened: [b, t, K] works and y comes back [b, t, N].
    gu           [M, 2 * I]  [gate | up] as the fused gate_up projection writes it (K = I)
    w            [N, K]      row-major (unit last stride, any row stride): q/k/v, o, gate/up, down, lm_head
    norm_w [K], bias [N]
    y            [M, N]      x's dtype; fp32 accumulation. Fresh tensors every call (graph-capture safe);
                             with delta=None, h is x itself, as in kernels.fused.add_rmsnorm.

Why. At batch 1 the decode step of a 135M Llama (SmolLM2: hidden 576, intermediate 1536, bf16) is
latency-bound everywhere: a projection's weight is 0.6-3.5 MB, which HBM streams in well under 1 us,
yet a cuBLAS GEMV takes 3.7-3.9 us, and the adds, norms and SwiGLU between them are further 1.2-1.5 us
launches. With these kernels a layer is four matrix-product launches and no elementwise ones:
    [add + rmsnorm + qkv] -> rope/cache -> attention -> [o_proj] -> [add + rmsnorm + gate_up] -> [silu*up + down]
(the residual add of a sublayer's output happens in the next norm, as DecoderLayer.pre/post carry it).

Design. One kernel (`_gemv_kernel`, the prologue picked by a constexpr) over a 1-D grid of N tiles:
program p owns outputs [p * BLOCK_N, (p + 1) * BLOCK_N) for all M rows.
  * K <= MAX_BLOCK_K (2048; every SmolLM2 projection): the program first loads its whole weight tile
    w [BLOCK_N, BLOCK_K] (BLOCK_K = next_pow2(K), masked; 16-byte vector loads), before touching the
    activations, so its entire share of the weight is in flight at once (one DRAM round trip, which
    is what a latency-bound GEMV costs), and holds it in registers for all rows. Then, per row m:
    the prologue builds the activation a [BLOCK_K] in registers, y[m, tile] = tl.sum(w * a[None, :], 1)
    (fp32 broadcast multiply + reduction over K), + bias, rounded, stored.
  * K > MAX_BLOCK_K: the same per row, looping over K in BLOCK_K chunks in order (the weight chunks
    are re-read per row, from L1/L2 after the first).
  Prologues: plain (load x); SiLU(gate) * up (load both halves of the gu row); add + RMSNorm, which
  needs the whole row before any element: pass 1 reads x (+ delta) -> h (program 0 alone stores it)
  and its sum of squares -> rstd; pass 2 re-reads x (+ delta) (L1 hits) and forms
  round(norm_w * round(h * rstd)) chunk by chunk. Every program recomputes the norm of every row: it
  is K <= 2048 elements from L2, overlapping the weight tile's DRAM latency, far cheaper than a launch.
  No tl.dot: at M <= 16 the tensor-core path pads M to 16 and needs BLOCK_N >= 16 (too few programs
  for N = 576), and the work here is loads, not FLOPs.

Block sizes depend on (N, K, the SM count) only, never on M: BLOCK_N is the largest power of two in
[4, 64] that still gives at least one program per SM, capped so the register-resident tile stays
<= 16K elements; num_warps gives each thread ~32-64 tile elements. For SmolLM2 on 132 SMs:
    qkv      N=960,   K=576  -> BLOCK_N 4,  240 programs, 4 warps
    o_proj   N=576,   K=576  -> BLOCK_N 4,  144 programs, 4 warps
    gate_up  N=3072,  K=576  -> BLOCK_N 16, 192 programs, 8 warps
    down     N=576,   K=1536 -> BLOCK_N 4,  144 programs, 8 warps (BLOCK_K 2048)
    lm_head  N=49152, K=576  -> BLOCK_N 16, 3072 programs, 8 warps (bandwidth-bound: many waves)

M-independence. A row's output is bit-identical whether it is computed alone (M=1) or inside a batch
(M=6, 16): M is only the trip count of a runtime loop (`do_not_specialize`, so M=1 runs the same
binary), the block sizes and num_warps do not depend on M, every row runs the same instructions on
the same register layouts, each output element is reduced over K in one fixed order (one tl.sum per
chunk, chunks in order; likewise the norm's sum of squares), and there is no split-K and no atomics.
So batching verify tokens never changes a token's outputs. (Triton also specialises on 16-byte
alignment of pointers and strides, which can change load layouts; rows of fresh tensors with
K * itemsize % 16 == 0, as all of SmolLM2's are, always get the same specialisation.)

Rounding follows the `*_reference` functions below, which compose kernels.fused's references:
h = round(x + delta) in fp32; n = round(round(h * rsqrt(mean(h^2) + eps)) * norm_w);
a = round(silu(gate) * up) in fp32; y = round(sum_k a_k w_k + bias) with an fp32 sum. Triton's
interpreter (TRITON_INTERPRET=1, the CPU tests) truncates fp32 -> bf16 where the GPU rounds to nearest
even; under it the kernel rounds bf16 by hand, so the CPU tests check the GPU's bits.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from kernels.decode_attention import _num_sms, triton
from kernels.fused import add_rmsnorm_reference, silu_mul_reference

if triton is not None:
    import triton.language as tl

MAX_ROWS = 16  # rows (batch x tokens) per call; callers use cuBLAS above
MAX_BLOCK_K = 2048  # K up to this is one register-resident chunk
_MAX_TILE = 16384  # elements of the weight tile [BLOCK_N, BLOCK_K] a program holds (64 per thread at 8 warps)
_PLAIN, _RMSNORM, _SILU_MUL = 0, 1, 2  # prologues


# ------------------------------------------------------------------------------------- references
def gemv_reference(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    y = x.float() @ w.float().t()  # [M, N], fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def add_rmsnorm_gemv_reference(x: Tensor, delta: Tensor | None, norm_w: Tensor, eps: float, w: Tensor,
                               bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    h, n = add_rmsnorm_reference(x, delta, norm_w, eps)
    return h, gemv_reference(n.to(x.dtype), w, bias)


def silu_mul_gemv_reference(gu: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    return gemv_reference(silu_mul_reference(gu), w, bias)


# ------------------------------------------------------------------------------------- kernel
if triton is not None:

    @triton.jit
    def _rne_bf16(x):
        """fp32 -> fp32 rounded to bf16's precision, to nearest even (so the cast to bf16 after it is exact).
        Used only under TRITON_INTERPRET=1, whose fp32 -> bf16 cast truncates; the GPU's cvt.rn rounds."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN

    @triton.jit(do_not_specialize=["M"])  # M=1 runs the same binary as any other M
    def _gemv_kernel(
        X, stride_xm,  # activations [M, K] ([M, 2K] = [gate | up] for SILU_MUL), unit last stride
        D, stride_dm,  # delta [M, K] (HAS_DELTA)
        NW,  # norm weight [K] (RMSNORM)
        H,  # h out [M, K] contiguous (HAS_DELTA; written by program 0 only)
        W, stride_wn,  # weight [N, K], unit last stride
        B,  # bias [N] (HAS_BIAS)
        Y, stride_ym,  # y out [M, N], unit last stride
        M, N, eps,
        K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PROLOGUE: tl.constexpr,  # 0: plain, 1: (add +) RMSNorm, 2: SiLU(gate) * up
        HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
        RNE: tl.constexpr,  # round fp32 -> bf16 by hand (the interpreter, bf16 only)
    ):
        DT = X.dtype.element_ty  # the activations' dtype: every rounding point rounds to it
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features of this program
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        w_rows = W + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
        if HAS_BIAS:
            bias = tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)  # [BLOCK_N]
        if K <= BLOCK_K:
            # One chunk: the whole weight tile is loaded first, once, and held in registers for every
            # row; nothing waits on the activations to issue it (one DRAM round trip per program).
            w_tile = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & (offs_k < K)[None, :], other=0.0,
                             eviction_policy="evict_first").to(tl.float32)  # [BLOCK_N, BLOCK_K]

        for m in range(M):  # a runtime loop: every row runs the same code on the same layouts
            x_row = X + m * stride_xm
            d_row = D + m * stride_dm
            if PROLOGUE == 1:
                # RMSNorm pass 1 over the row: h = round(x + delta) (program 0 stores it), sum of h^2
                ss = tl.full([BLOCK_K], 0.0, tl.float32)  # (tl.full: tl.zeros is slow to interpret)
                for k0 in range(0, K, BLOCK_K):
                    k = k0 + offs_k
                    kmask = k < K
                    hf = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
                    if HAS_DELTA:
                        hf += tl.load(d_row + k, mask=kmask, other=0.0).to(tl.float32)
                        if RNE:
                            hf = _rne_bf16(hf)
                        h = hf.to(DT)
                        if pid == 0:
                            tl.store(H + m * K + k, h, mask=kmask)
                        hf = h.to(tl.float32)
                    ss += hf * hf
                rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)

            acc = tl.full([BLOCK_N], 0.0, tl.float32)
            for k0 in range(0, K, BLOCK_K):  # a single trip when K <= BLOCK_K; chunks in a fixed order
                k = k0 + offs_k
                kmask = k < K
                # ---- prologue: this chunk of row m's activation a [BLOCK_K], fp32 holding DT values
                if PROLOGUE == 0:
                    a = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
                elif PROLOGUE == 1:  # a = round(norm_w * round(h * rstd)); h again (L1 hits)
                    hf = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
                    if HAS_DELTA:
                        hf += tl.load(d_row + k, mask=kmask, other=0.0).to(tl.float32)
                        if RNE:
                            hf = _rne_bf16(hf)
                        hf = hf.to(DT).to(tl.float32)
                    a = hf * rstd
                    if RNE:
                        a = _rne_bf16(a)
                    a = a.to(DT).to(tl.float32) * tl.load(NW + k, mask=kmask, other=0.0).to(tl.float32)
                    if RNE:
                        a = _rne_bf16(a)
                    a = a.to(DT).to(tl.float32)
                else:  # a = round(silu(gate) * up), gate = x[:K], up = x[K:2K]
                    g = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
                    a = g / (1.0 + tl.exp(-g)) * tl.load(x_row + K + k, mask=kmask, other=0.0).to(tl.float32)
                    if RNE:
                        a = _rne_bf16(a)
                    a = a.to(DT).to(tl.float32)
                # ---- the product: y[m, tile] += sum_k w[tile, k] * a[k], fp32
                if K <= BLOCK_K:
                    w = w_tile
                else:  # re-read per row: L1 / L2 hits after the first row
                    w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :],
                                other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
                acc += tl.sum(w * a[None, :], 1)  # [BLOCK_N]
            y = acc  # [BLOCK_N]
            if HAS_BIAS:
                y += bias
            if RNE:
                y = _rne_bf16(y)
            tl.store(Y + m * stride_ym + offs_n, y.to(Y.dtype.element_ty), mask=nmask)


# ------------------------------------------------------------------------------------- launch
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def gemv_config(n: int, k: int, device: torch.device, block_k: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [N, K] weight: a function of N, K and the SM count, never
    of M (which keeps a row's result independent of the batch it is computed in)."""
    bk = block_k or min(triton.next_power_of_2(k), MAX_BLOCK_K)
    assert bk & (bk - 1) == 0, f"block_k must be a power of two, got {bk}"
    sms = _num_sms(device)
    bn = 4
    while bn < 64 and 2 * bn * bk <= _MAX_TILE and triton.cdiv(n, 2 * bn) >= sms:
        bn *= 2
    return bn, bk, max(1, min(8, bn * bk // 1024))


def _as_rows(t: Tensor, k: int, name: str) -> Tensor:
    assert t.shape[-1] == k, f"{name}: last dim {t.shape[-1]}, expected {k}"
    t2 = t.reshape(-1, k)  # a view for 2-D inputs (any row stride) and contiguous leading dims
    assert t2.stride(-1) == 1 or k == 1, f"{name} must be contiguous along its last dim"
    assert t2.shape[0] <= MAX_ROWS, f"{name}: {t2.shape[0]} rows > MAX_ROWS={MAX_ROWS} (use cuBLAS)"
    return t2


def _launch(prologue: int, a: Tensor, k: int, w: Tensor, bias: Tensor | None, delta: Tensor | None = None,
            norm_w: Tensor | None = None, eps: float = 0.0, block_k: int | None = None) -> tuple[Tensor | None, Tensor]:
    """a: the activations as [M, K] ([M, 2K] for SILU_MUL) -> (h [M, K] or None, y [M, N])."""
    n = w.shape[0]
    assert w.shape[1] == k and w.stride(1) == 1, f"w must be [N, {k}] with a unit last stride, got {tuple(w.shape)}"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    m = a.shape[0]
    y = torch.empty(m, n, dtype=a.dtype, device=a.device)
    h = torch.empty(m, k, dtype=a.dtype, device=a.device) if delta is not None else None
    if m == 0:
        return h, y
    bn, bk, warps = gemv_config(n, k, a.device, block_k)
    d = delta if delta is not None else a
    _gemv_kernel[(triton.cdiv(n, bn),)](
        a, a.stride(0), d, d.stride(0), norm_w if norm_w is not None else a, h if h is not None else y,
        w, w.stride(0), bias if bias is not None else w, y, y.stride(0),
        m, n, eps,
        K=k, BLOCK_N=bn, BLOCK_K=bk, PROLOGUE=prologue, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None,
        RNE=a.dtype == torch.bfloat16 and _interpreting(),
        num_warps=warps, num_stages=1 if k <= bk else 2,
    )
    return h, y


def gemv(x: Tensor, w: Tensor, bias: Tensor | None = None, *, block_k: int | None = None) -> Tensor:
    """y = x @ w^T (+ bias): x [..., K] (<= MAX_ROWS rows), w [N, K] -> y [..., N] in x's dtype.
    block_k overrides the K chunk (tests of the chunked path, tuning)."""
    if triton is None:
        return gemv_reference(x, w, bias)
    k = w.shape[1]
    _, y = _launch(_PLAIN, _as_rows(x, k, "x"), k, w, bias, block_k=block_k)
    return y.view(*x.shape[:-1], w.shape[0])


def add_rmsnorm_gemv(x: Tensor, delta: Tensor | None, norm_w: Tensor, eps: float, w: Tensor,
                     bias: Tensor | None = None, *, block_k: int | None = None) -> tuple[Tensor, Tensor]:
    """(h, y): h = x + delta (x when delta is None), y = (norm_w * rmsnorm(h)) @ w^T (+ bias);
    x, delta [..., K], norm_w [K], w [N, K] -> h [..., K], y [..., N]."""
    if triton is None:
        return add_rmsnorm_gemv_reference(x, delta, norm_w, eps, w, bias)
    k = w.shape[1]
    x2 = _as_rows(x, k, "x")
    d2 = None
    if delta is not None:
        assert delta.shape == x.shape, f"delta {tuple(delta.shape)} != x {tuple(x.shape)}"
        d2 = _as_rows(delta, k, "delta")
    assert norm_w.shape == (k,) and norm_w.is_contiguous()
    h, y = _launch(_RMSNORM, x2, k, w, bias, delta=d2, norm_w=norm_w, eps=float(eps), block_k=block_k)
    return (x if h is None else h.view(x.shape)), y.view(*x.shape[:-1], w.shape[0])


def silu_mul_gemv(gu: Tensor, w: Tensor, bias: Tensor | None = None, *, block_k: int | None = None) -> Tensor:
    """y = (silu(gate) * up) @ w^T (+ bias): gu [..., 2I] = [gate | up], w [N, I] -> y [..., N]."""
    if triton is None:
        return silu_mul_gemv_reference(gu, w, bias)
    k = w.shape[1]
    assert gu.shape[-1] == 2 * k, f"gu: last dim {gu.shape[-1]}, expected 2 * {k}"
    g2 = _as_rows(gu, 2 * k, "gu")
    _, y = _launch(_SILU_MUL, g2, k, w, bias, block_k=block_k)
    return y.view(*gu.shape[:-1], w.shape[0])
