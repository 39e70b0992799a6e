"""Batch-invariant projections (kernels/gemv.py) against their plain-torch references: TRITON_INTERPRET=1
on CPU (fp32 and bf16), compiled on a GPU. Also: a row's outputs do not depend on the batch it is in (M at
every edge of the launch on CPU, every M to 256 on a GPU; the fused norm and the normalised-rows path), the
norm's rstd is the reference's bit for bit, and the argmax epilogue is torch.argmax of the rounded outputs
(ties to the lowest index)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from kernels import gemv as G

pytestmark = pytest.mark.skipif(G.triton is None, reason="triton is not installed")
DEVICES = ["cuda"] if torch.cuda.is_available() else (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
EPS = 1e-5
# rmsnorm: add_rmsnorm_gemv with delta=None; swiglu / geglu: its gated epilogues over interleaved gate / up rows;
# cat_index: cat_rmsnorm_gemv over an embedding table; cat_plain: norm=False
KINDS = ["gemv", "add_rmsnorm", "rmsnorm", "swiglu", "geglu", "cat_rmsnorm", "cat_index", "cat_plain"]
NORM_KINDS = ("add_rmsnorm", "rmsnorm", "swiglu", "geglu")  # add_rmsnorm_gemv
GLU = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}
ARGMAX_KINDS = ["gemv", "add_rmsnorm", "rmsnorm", "cat_rmsnorm", "cat_index", "cat_plain"]


@dataclass
class Case:
    """A call's arguments: `rows` are per row (cut to test row subsets), `fixed` are the weights."""

    kind: str
    rows: dict
    fixed: dict

    def sub(self, rows: slice) -> "Case":
        """The same call on a subset of the rows, as fresh tensors."""
        return Case(self.kind, {k: v[rows].clone() for k, v in self.rows.items()}, self.fixed)

    def run(self, **kw) -> tuple:
        """-> (y,) or (h, y); y is ids with argmax=True."""
        r, f, kind = self.rows, self.fixed, self.kind
        if kind == "gemv":
            return (G.gemv(r["x"], f["w"], f["bias"], **kw),)
        if kind in NORM_KINDS:
            return G.add_rmsnorm_gemv(
                r["x"], r.get("delta"), f["norm_w"], EPS, f["w"], f["bias"], glu=GLU.get(kind), **kw
            )
        x1 = f["table"] if kind == "cat_index" else r["x1"]
        return (
            G.cat_rmsnorm_gemv(
                x1,
                r["x2"],
                f["nw1"],
                f["nw2"],
                EPS,
                f["w"],
                f["bias"],
                index1=r.get("index1"),
                norm=kind != "cat_plain",
                **kw,
            ),
        )

    def reference(self) -> tuple:
        r, f, kind = self.rows, self.fixed, self.kind
        if kind == "gemv":
            return (G.gemv_reference(r["x"], f["w"], f["bias"]),)
        if kind in NORM_KINDS:
            h, y = G.add_rmsnorm_gemv_reference(r["x"], r.get("delta"), f["norm_w"], EPS, f["w"], f["bias"])
            return h, (G.glu_reference(y, GLU[kind]) if kind in GLU else y)
        x1 = f["table"] if kind == "cat_index" else r["x1"]
        return (
            G.cat_rmsnorm_gemv_reference(
                x1,
                r["x2"],
                f["nw1"],
                f["nw2"],
                EPS,
                f["w"],
                f["bias"],
                index1=r.get("index1"),
                norm=kind != "cat_plain",
            ),
        )


def _case(
    kind: str,
    m: int,
    k: int,
    n: int,
    dtype,
    device,
    bias: bool,
    seed: int = 0,
    row_pad: int = 0,
    lead: tuple = (),
    k1: int | None = None,
) -> Case:
    """Activations ~N(0, 1), w ~N(0, 1/K): outputs of magnitude ~1. Rows [*lead, m]; with row_pad, the
    activations are views with a row stride past their width. The cat kinds split K at k1 (K/2 + 8:
    the halves meet inside a chunk)."""
    g = torch.Generator().manual_seed(seed)

    def act(cols):
        full = torch.randn(*lead, m, cols + row_pad, generator=g).to(device=device, dtype=dtype)
        return full[..., :cols]

    def norm_w(cols):
        return (torch.rand(cols, generator=g) + 0.5).to(device=device, dtype=dtype)

    fixed = {
        "w": (torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=dtype),
        "bias": torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None,
    }
    if kind == "gemv":
        return Case(kind, {"x": act(k)}, fixed)
    if kind in NORM_KINDS:
        rows = {"x": act(k), "delta": act(k)} if kind != "rmsnorm" else {"x": act(k)}
        return Case(kind, rows, fixed | {"norm_w": norm_w(k)})
    k1 = k1 or k // 2 + 8
    fixed |= {"nw1": norm_w(k1), "nw2": norm_w(k - k1)}
    if kind == "cat_index":  # x1 is an embedding table, looked up in the prologue
        fixed["table"] = torch.randn(50, k1, generator=g).to(device=device, dtype=dtype)
        return Case(
            kind, {"x2": act(k - k1), "index1": torch.randint(0, 50, (*lead, m), generator=g).to(device)}, fixed
        )
    return Case(kind, {"x1": act(k1), "x2": act(k - k1)}, fixed)


def _check(case: Case, got: tuple, dtype) -> None:
    want = case.reference()
    y, ry = got[-1], want[-1]
    assert y.dtype == ry.dtype and y.shape == ry.shape
    if dtype == torch.float32:
        torch.testing.assert_close(y, ry, atol=1e-5, rtol=1e-5)
    else:  # the same roundings as the reference; fp32 sums in another order: within ~1 bf16 ulp
        torch.testing.assert_close(y.float(), ry.float(), atol=2e-2, rtol=1e-2)
    if case.kind in NORM_KINDS:
        assert torch.equal(got[0], want[0])  # h: the residual stream, bit-exact
        if case.kind == "rmsnorm":
            assert got[0] is case.rows["x"]  # delta=None: h is x itself


# ------------------------------------------------------------------------------------- vs reference
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, m, bias",
    [(torch.float32, 1, False), (torch.float32, 17, True), (torch.float32, 70, True)]
    + [(torch.bfloat16, m, bias) for m, bias in [(1, False), (6, True), (17, True), (48, False), (130, True)]],
    ids=lambda v: {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(v, str(v)),
)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(device, dtype, kind, m, bias):
    """K = 80 in one ragged chunk (the cat kinds' halves meet inside it), N = 24 in tiles of 16 (the last
    one ragged), M in one row tile of 16 with the norm fused (M <= 16), or in tiles of 64 with the rows
    normalised first (17, 48, 70, 130). bf16 at every M (its roundings are the point), fp32 at three."""
    case = _case(kind, m, 80, 24, dtype, device, bias, seed=m)
    _check(case, case.run(block_n=16), dtype)


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [576, 2304])
def test_k_sizes_match_reference(device, dtype, kind, k):
    """SmolLM2's hidden 576 in chunks of 128 (4 whole + 64), and K = 2304 (18 chunks)."""
    case = _case(kind, 6, k, 24, dtype, device, bias=True, seed=k)
    _check(case, case.run(), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_outputs_round_to_nearest_even(device):
    """y = x0 + x1 (w = [1, 1]): an exact fp32 sum, then one rounding to bf16, which must be the GPU's
    (and torch's) round-to-nearest-even bit for bit, ties included (under the interpreter, by hand)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    one, half_ulp = 1.0, 2.0**-8  # bf16's ulp at 1 is 2^-7
    x[:4] = torch.tensor([[one, half_ulp], [one + 2 * half_ulp, half_ulp], [-one, -half_ulp], [one, 0.75 * half_ulp]])
    x = x.to(device, torch.bfloat16)
    w = torch.ones(16, 2, device=device, dtype=torch.bfloat16)
    y = G.gemv(x, w)
    assert torch.equal(y, G.gemv_reference(x, w))
    assert y[:4, 0].tolist() == [1.0, 1.015625, -1.0, 1.0]  # ties to even: 1 + 2^-8 -> 1; 1 + 3 * 2^-8 -> 1 + 2^-6


# ------------------------------------------------------------------------------------- batch invariance
# At N = 16 the launch changes with M only at the row tile (16, then 64), the fused norm (M <= 16; above,
# the rows are normalised first, one program per row whatever M) and the count of row tiles: M at each edge
# of the fused range, then one and two row tiles, each partial and whole. Every M in 1..65 and 100..256 ran
# 4x as long under the interpreter and checked no other path; every M in 1..256 is the GPU test's
# (test_shapes_bf16_on_gpu_are_batch_invariant). Argmax at 1, 17 and 65: one M of each kind of launch.
BATCH, BATCH_MS = 144, [1, 2, 3, 8, 15, 16, 17, 64, 65, 128]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_row_is_independent_of_batch(device, dtype, kind):
    """A batch of 144 rows (2 row tiles of 64 and a partial one), then M at every edge of the
    launch (BATCH_MS) over a window that slides with M: each row's outputs (y, h, and the argmax ids) bitwise
    those of the whole batch. K = 200 (two chunks, the last ragged)."""
    case = _case(kind, BATCH, 200, 16, dtype, device, bias=True, seed=5)
    full = case.run()
    _check(case, full, dtype)
    ids = case.run(argmax=True)[-1] if kind in ARGMAX_KINDS else None
    for m in BATCH_MS:
        start = (m * 37) % (BATCH + 1 - m)
        sub = case.sub(slice(start, start + m))
        for a, b in zip(sub.run(), full):
            assert torch.equal(a, b[start : start + m]), (kind, m, start)
        if ids is not None and m % 8 == 1:
            assert torch.equal(sub.run(argmax=True)[-1], ids[start : start + m]), (kind, m)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, n", [("gemv", 8448), ("add_rmsnorm", 1056), ("swiglu", 1056), ("cat_index", 1056)])
def test_wide_weights_past_one_row_tile(device, kind, n):
    """N > 1024 past two 64-row tiles: 128-row tiles (64-wide column tiles, 256-wide past N = 8192), the
    epilogues over them: the reference's outputs, and each row (and its argmax) bitwise the same at M = 1, 65
    and 130."""
    case = _case(kind, 130, 96, n, torch.bfloat16, device, bias=False, seed=7)
    assert G.gemv_config(n, 96, 130).rows == 128 and G.gemv_config(n, 96, 130).block_n == (256 if n > 8192 else 64)
    full = case.run()
    _check(case, full, torch.bfloat16)
    ids = case.run(argmax=True)[-1] if kind in ARGMAX_KINDS else None
    for m in (1, 65):
        sub = case.sub(slice(130 - m, 130))
        for a, b in zip(sub.run(), full):
            assert torch.equal(a, b[130 - m :]), (kind, m)
        if ids is not None:
            assert torch.equal(sub.run(argmax=True)[-1], ids[130 - m :]), (kind, m)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [3, 100], ids=["fused", "rows_first"])
def test_norm_scale_is_the_references_bit_for_bit(device, m):
    """w selects one column per output (an exact product), so y = round(x_k * norm_w_k * rstd): equal to the
    reference bit for bit, rstd included (its lanes and tree are the kernels'), at K = 200 (ragged lanes)."""
    g = torch.Generator().manual_seed(0)
    k, n = 200, 32
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)).to(device, torch.bfloat16)
    delta = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    norm_w = (torch.rand(k, generator=g) + 0.5).to(device, torch.bfloat16)
    w = torch.zeros(n, k)
    w[torch.arange(n), torch.randint(0, k, (n,), generator=g)] = 1.0
    w = w.to(device, torch.bfloat16)
    got = G.add_rmsnorm_gemv(x, delta, norm_w, EPS, w)
    want = G.add_rmsnorm_gemv_reference(x, delta, norm_w, EPS, w)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
@pytest.mark.parametrize("m", [6, 20], ids=["fused", "rows_first"])
def test_zero1_rows_read_the_table_as_zeros(device, dtype, m):
    """cat_rmsnorm_gemv over an embedding table with zero1 (public MTP layers' position 0): a marked row is
    bitwise the call whose index points at an all-zero table row, and the reference's; an unmarked row is
    bitwise the call without zero1; a marked row differs from it (the flag is read)."""
    case = _case("cat_index", m, 80, 24, dtype, device, bias=False, seed=11)
    table, zero1 = case.fixed["table"], torch.arange(m, device=device) % 3 == 0
    f, x2, index1 = case.fixed, case.rows["x2"], case.rows["index1"]
    args = (f["nw1"], f["nw2"], EPS, f["w"])
    got = G.cat_rmsnorm_gemv(table, x2, *args, index1=index1, zero1=zero1)
    zeros_row = torch.cat([table, torch.zeros_like(table[:1])])  # row 50: all zeros
    as_zero_row = G.cat_rmsnorm_gemv(zeros_row, x2, *args, index1=torch.where(zero1, 50, index1))
    plain = G.cat_rmsnorm_gemv(table, x2, *args, index1=index1)
    assert torch.equal(got, as_zero_row)
    assert torch.equal(got[~zero1], plain[~zero1]) and not torch.allclose(got[zero1], plain[zero1])
    want = G.cat_rmsnorm_gemv_reference(table, x2, *args, index1=index1, zero1=zero1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


# ------------------------------------------------------------------------------------- argmax epilogue
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ARGMAX_KINDS)
def test_argmax_is_the_argmax_of_the_outputs(device, kind, dtype=torch.bfloat16):
    """bf16: ids = torch.argmax of the kernel's own y (bitwise: the same rounded values) and of the
    reference's; with offsets, ids + offsets[ids]; h as without argmax. 17 rows (two row tiles), N = 40 in 3 tiles
    of 16, the last one ragged."""
    m, n = 17, 40
    case = _case(kind, m, 80, n, dtype, device, bias=True, seed=3)
    y = case.run(block_n=16)
    ids = case.run(block_n=16, argmax=True)
    assert ids[-1].dtype == torch.int64 and ids[-1].shape == (m,)
    assert torch.equal(ids[-1], y[-1].argmax(-1))
    assert torch.equal(ids[-1], G.argmax_reference(case.reference()[-1]))
    if len(y) == 2:
        assert torch.equal(ids[0], y[0])
    offsets = torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(0)).to(device)
    mapped = case.run(block_n=16, argmax=True, offsets=offsets)[-1]
    assert torch.equal(mapped, ids[-1] + offsets[ids[-1]])


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
def test_argmax_ties_go_to_the_lowest_index(device, dtype):
    """Exact integer outputs (y[m] = w[:, m] . x[m]) with planted maxima over N = 100 in tiles of 16:
    row 0 ties across tiles (20 and 70), row 1 inside a tile (35 and 33), row 2 ties only once rounded
    to bf16 (256 and 257 = 256 + 1: bf16 rounds 257 to 256, so bf16 takes 10, fp32 takes 90), row 16
    (the second row tile) ties at the first and the last column; the rest all equal (-> 0)."""
    m, k, n = 20, 32, 100
    x = torch.zeros(m, k)
    x[torch.arange(m), torch.arange(m)] = 1.0  # row r reads column r of w
    x[2, 31] = 1.0  # ... and row 2 also column 31
    w = torch.zeros(n, k)
    w[20, 0] = w[70, 0] = 5.0
    w[35, 1] = w[33, 1] = 3.0
    w[10, 2] = w[90, 2] = 256.0
    w[90, 31] = 1.0
    w[0, 16] = w[99, 16] = 2.0
    w[50, 17] = -1.0  # row 17: all zero but one negative
    x, w = x.to(device, dtype), w.to(device, dtype)
    want = [20, 33, 10 if dtype == torch.bfloat16 else 90] + [0] * 13 + [0, 0, 0, 0]
    ids = G.gemv(x, w, argmax=True, block_n=16)
    assert ids.tolist() == want
    y = G.gemv_reference(x, w)
    assert ids.tolist() == G.argmax_reference(y).tolist()  # torch.argmax of the rounded y
    offsets = torch.arange(n, device=device) * 3 - 7  # a d2t-style map: draft id -> target id - draft id
    assert G.gemv(x, w, argmax=True, offsets=offsets, block_n=16).tolist() == [4 * i - 7 for i in want]
    h, ids2 = G.add_rmsnorm_gemv(x, None, torch.ones(k, device=device, dtype=dtype), EPS, w, argmax=True, block_n=16)
    assert h is x and ids2[:2].tolist() == want[:2]  # the norm scales each row: its argmax stays


# ------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_rows(device, kind):
    """Activations as views with a row stride past their width: the results of contiguous copies. (Not
    bit for bit on a GPU: Triton specialises on 16-byte-aligned strides, which can change the load
    layout and so a reduction's order; a call site's strides do not change with the batch.)"""
    case = _case(kind, 4, 64, 20, torch.float32, device, bias=True, seed=3, row_pad=24)
    assert all(v.stride(0) > v.shape[-1] for v in case.rows.values() if v.is_floating_point())
    got = case.run()
    _check(case, got, torch.float32)
    contig = Case(kind, {k: v.contiguous() for k, v in case.rows.items()}, case.fixed)
    for a, b in zip(got, contig.run()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_leading_dims_are_flattened(device, kind):
    """[b, t, K] in -> [b, t, N] out, or ids [b, t] (as the model's decode / verify activations come)."""
    case = _case(kind, 3, 64, 20, torch.float32, device, bias=False, seed=9, lead=(2,))
    got = case.run()
    assert got[-1].shape == (2, 3, 10 if kind in GLU else 20)  # gated: one output per gate / up pair
    _check(case, got, torch.float32)
    if kind in ARGMAX_KINDS:
        ids = case.run(argmax=True)[-1]
        assert ids.shape == (2, 3) and torch.equal(ids, got[-1].argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_what_it_does_not_handle(device):
    w = torch.randn(16, 32, device=device)
    with pytest.raises(AssertionError, match="contiguous"):
        G.gemv(torch.randn(32, 4, device=device).t(), w)  # unit row stride, not unit column stride
    with pytest.raises(AssertionError, match="even N"):
        G.add_rmsnorm_gemv(
            torch.randn(2, 32, device=device),
            None,
            torch.ones(32, device=device),
            EPS,
            torch.randn(15, 32, device=device),
            glu="silu",
        )  # gate / up pairs
    with pytest.raises(AssertionError, match="K1 \\+ K2"):
        G.cat_rmsnorm_gemv(torch.randn(2, 16), torch.randn(2, 8), None, None, EPS, w, norm=False)
    with pytest.raises(AssertionError, match="index1"):
        G.cat_rmsnorm_gemv(
            torch.randn(9, 16),
            torch.randn(2, 16),
            None,
            None,
            EPS,
            w,
            norm=False,
            index1=torch.zeros(3, dtype=torch.int64),
        )
    with pytest.raises(AssertionError, match="power of two"):
        G.gemv(torch.randn(2, 32, device=device), w, block_n=8)  # below tl.dot's 16


def test_config_fits_shared_memory_and_fills_the_gpu():
    """Every SmolLM2-135M / EAGLE3 / 8B projection at M = 1..256: a row tile that holds M (ROW_TILES, then
    more row tiles), chunks of 128 columns (the norm's lanes) up to one row tile and of 64 past it,
    pipelined buffers within the shared-memory budget, (up to FUSED_M rows) the widest column tiles
    that give _PROGRAMS programs, and (narrow weights up to 64 rows) 16-row tiles in one wave."""
    ms = (1, 16, 17, 48, 64, 65, 128, 129, 1000)
    assert [G.row_tile(m, 10240) for m in ms] == [16, 16, 64, 64, 64, 128, 128, 128, 128]
    assert [G.row_tile(m, 4096) for m in ms] == [16, 16, 64, 64, 64, 64, 64, 128, 128]
    assert [G.row_tile(m, 1024) for m in ms] == [16, 16, 16, 16, 16, 64, 64, 64, 64]
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (960, 1152), (10240, 576)]
    shapes += [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    for n, k in shapes:
        for m in (1, 6, 17, 48, 192, 256):
            for act_tiles in (1, 2):
                c = G.gemv_config(n, k, m, act_tiles=act_tiles)
                assert c.rows == G.row_tile(m, n) and c.num_stages >= 1
                assert c.block_k in (G.BLOCK_K, G.WIDE_BLOCK_K) and (c.block_k == G.BLOCK_K or m > G.ONE_TILE_M)
                if c.num_stages > 2:
                    assert c.num_stages * (c.block_k * c.block_n + act_tiles * c.rows * c.block_k) * 2 <= G._SMEM_BUDGET
                programs = -(-n // c.block_n) * -(-m // c.rows)
                assert m > G.FUSED_M or programs >= G._PROGRAMS or c.block_n == 16, (n, k, m, c)
                if G.FUSED_M < m <= G.ONE_TILE_M and n <= G.NARROW_N:  # 16-row tiles, one wave
                    assert c.rows == 16 and (programs <= G._SMS or c.block_n == 64), (n, k, m, c)
    c = G.gemv_config(576, 576, 1, block_n=32, num_warps=8, num_stages=2)
    assert c == G.GemvConfig(16, 32, G.BLOCK_K, 8, 2)


# ------------------------------------------------------------------------------------- GPU, bf16
GPU_SHAPES = [  # (kind, K, N): SmolLM2-135M's layer and lm_head, its EAGLE3 head, Llama-3.1-8B's layer and lm_head
    ("add_rmsnorm", 576, 960),
    ("gemv", 576, 576),
    ("swiglu", 576, 3072),
    ("gemv", 1536, 576),
    ("rmsnorm", 576, 49152),
    ("cat_index", 1152, 960),
    ("cat_rmsnorm", 1152, 960),
    ("swiglu", 576, 1536),
    ("rmsnorm", 576, 10240),
    ("add_rmsnorm", 4096, 6144),
    ("gemv", 4096, 4096),
    ("swiglu", 4096, 28672),
    ("geglu", 4096, 28672),
    ("gemv", 14336, 4096),
    ("rmsnorm", 4096, 128256),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind, k, n", GPU_SHAPES, ids=[f"{kd}_{n}x{k}" for kd, k, n in GPU_SHAPES])
def test_shapes_bf16_on_gpu_are_batch_invariant(kind, k, n):
    """Every SmolLM2-135M / EAGLE3 / Llama-3.1-8B projection in bf16, compiled: the references' roundings, h
    bit-exact, and every M from 1 to 256 (a window sliding with M over a batch of 256) bitwise the rows of the
    whole batch; the lm_heads' argmax (with d2t-style offsets) equal to torch.argmax of the kernel's y."""
    case = _case(kind, 256, k, n, torch.bfloat16, "cuda", bias=False, seed=k + n, k1=k // 2)
    full = case.run()
    _check(case, full, torch.bfloat16)
    for m in range(1, 257):
        start = (m * 37) % (257 - m)
        for a, b in zip(case.sub(slice(start, start + m)).run(), full):
            assert torch.equal(a, b[start : start + m]), (kind, k, n, m, start)
    if kind in ARGMAX_KINDS and n >= 10240:
        offsets = torch.randint(0, 1000, (n,), device="cuda")
        ids = case.run(argmax=True, offsets=offsets)[-1]
        want = full[-1].argmax(-1)
        assert torch.equal(ids, want + offsets[want]), (kind, n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replays_in_a_cuda_graph():
    """Both paths (the norm fused at M = 1, the rows normalised first at M = 200) inside a captured graph."""
    for m in (1, 200):
        case = _case("add_rmsnorm", m, 576, 960, torch.bfloat16, "cuda", bias=False, seed=1)
        want = case.run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = case.run()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, want))
