"""Batch-invariant GEMV kernels (kernels/gemv.py) against their plain-torch references: TRITON_INTERPRET=1
on CPU (fp32 and bf16), compiled on a GPU. Also: a row's outputs do not depend on the batch it is in,
and the argmax epilogue is torch.argmax of the rounded outputs (ties to the lowest index)."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import pytest
import torch

from kernels import gemv as G

pytestmark = pytest.mark.skipif(G.triton is None, reason="triton is not installed")
DEVICES = ["cuda"] if torch.cuda.is_available() else (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
EPS = 1e-5
# rmsnorm: add_rmsnorm_gemv with delta=None; swiglu: its epilogue over interleaved gate / up rows;
# cat_index: cat_rmsnorm_gemv over an embedding table; cat_plain: norm=False
KINDS = ["gemv", "add_rmsnorm", "rmsnorm", "swiglu", "cat_rmsnorm", "cat_index", "cat_plain"]
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
        if kind in ("add_rmsnorm", "rmsnorm", "swiglu"):
            return G.add_rmsnorm_gemv(
                r["x"], r.get("delta"), f["norm_w"], EPS, f["w"], f["bias"], swiglu=kind == "swiglu", **kw
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
        if kind in ("add_rmsnorm", "rmsnorm", "swiglu"):
            h, y = G.add_rmsnorm_gemv_reference(r["x"], r.get("delta"), f["norm_w"], EPS, f["w"], f["bias"])
            return h, (G.swiglu_reference(y) if kind == "swiglu" else y)
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
    if kind in ("add_rmsnorm", "rmsnorm", "swiglu"):
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
    if case.kind in ("add_rmsnorm", "rmsnorm", "swiglu"):
        assert torch.equal(got[0], want[0])  # h: the residual stream, bit-exact
        if case.kind == "rmsnorm":
            assert got[0] is case.rows["x"]  # delta=None: h is x itself


# ------------------------------------------------------------------------------------- vs reference
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, m, bias",
    [(torch.float32, 1, False), (torch.float32, 17, True)]
    + [(torch.bfloat16, m, bias) for m, bias in [(1, False), (6, True), (16, False), (17, True), (48, False)]],
    ids=lambda v: {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(v, str(v)),
)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(device, dtype, kind, m, bias):
    """K = 80 in chunks of 32 (the last one ragged; the cat kinds' halves meet inside a chunk), N = 24 in
    tiles of 16 (the last one ragged), M across one and several row tiles of 16 (48: also in the batch
    invariance test). bf16 at every M (its roundings are the point), fp32 at two."""
    case = _case(kind, m, 80, 24, dtype, device, bias, seed=m)
    _check(case, case.run(block_k=32), dtype)


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "k, block_k", [(576, 256), (576, 1024), (2304, None)], ids=["576_chunked", "576_one_chunk", "2304"]
)
def test_k_sizes_match_reference(device, dtype, kind, k, block_k):
    """SmolLM2's hidden 576 in chunks of 256 (2 whole + 64), in one chunk (the weight loaded before the
    prologue), and K = 2304 > 2048 (9 chunks of the default 256)."""
    case = _case(kind, 6, k, 24, dtype, device, bias=True, seed=k)
    _check(case, case.run(block_k=block_k), dtype)


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
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, block_k", [(torch.float32, None), (torch.bfloat16, 32)], ids=["fp32_one_chunk", "bf16_chunked"]
)
@pytest.mark.parametrize("kind", KINDS)
def test_row_is_independent_of_batch(device, dtype, block_k, kind):
    """Row 37 of a batch of 48 (row tile 2 of 3, position 5), the same row in a batch of 6 (position 3) and
    alone (M = 1): bitwise the same outputs (y, h, and the argmax ids). K = 80 in one chunk (the weight
    loaded first) or three; the batch of 48 also against the reference."""
    case = _case(kind, 48, 80, 16, dtype, device, bias=True, seed=5)
    variants = [(case, 37), (case.sub(slice(34, 40)), 3), (case.sub(slice(37, 38)), 0)]
    batch = case.run(block_k=block_k)
    _check(case, batch, dtype)
    outs = [[t[i : i + 1] for t in (batch if c is case else c.run(block_k=block_k))] for c, i in variants]
    if kind in ARGMAX_KINDS:
        for (c, i), out in zip(variants, outs):
            out.append(c.run(block_k=block_k, argmax=True)[-1][i : i + 1])
    for out in outs[1:]:
        for a, b in zip(outs[0], out):
            assert torch.equal(a, b), kind


# ------------------------------------------------------------------------------------- argmax epilogue
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ARGMAX_KINDS)
def test_argmax_is_the_argmax_of_the_outputs(device, kind, dtype=torch.bfloat16):
    """bf16: ids = torch.argmax of the kernel's own y (bitwise: the same rounded values) and of the
    reference's; with offsets, ids + offsets[ids]; h as without argmax. 17 rows (two row tiles), N = 40 in 3 tiles
    of 16, the last one ragged."""
    m, n = 17, 40
    case = _case(kind, m, 80, n, dtype, device, bias=True, seed=3)
    y = case.run(block_k=32)
    ids = case.run(block_k=32, argmax=True)
    assert ids[-1].dtype == torch.int64 and ids[-1].shape == (m,)
    assert torch.equal(ids[-1], y[-1].argmax(-1))
    assert torch.equal(ids[-1], G.argmax_reference(case.reference()[-1]))
    if len(y) == 2:
        assert torch.equal(ids[0], y[0])
    offsets = torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(0)).to(device)
    mapped = case.run(block_k=32, argmax=True, offsets=offsets)[-1]
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
    assert got[-1].shape == (2, 3, 10 if kind == "swiglu" else 20)  # swiglu: one output per gate / up pair
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
            swiglu=True,
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


def test_config_depends_on_the_weight_only():
    """SmolLM2-135M's and its EAGLE3 head's projections: no M anywhere in the choice; the tile by N;
    every chunk of K in flight (num_stages = chunks + 1) within the shared-memory budget, but for the
    lm_heads (3 stages)."""
    assert "m" not in inspect.signature(G.gemv_config).parameters
    cpu = torch.device("cpu")
    shapes = {
        "qkv": (960, 576),
        "o_proj": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
        "lm_head": (49152, 576),
        "draft_qkv": (960, 1152),
        "draft_gate_up": (1536, 576),
        "draft_down": (576, 768),
        "draft_lm_head": (10240, 576),
    }
    got = {name: G.gemv_config(n, k, cpu) for name, (n, k) in shapes.items()}
    C = G.GemvConfig  # (block_n, block_k, num_warps, num_stages)
    assert got == {
        "qkv": C(32, 256, 4, 4),
        "o_proj": C(32, 256, 4, 4),
        "gate_up": C(64, 128, 8, 6),
        "down": C(32, 256, 4, 7),
        "lm_head": C(64, 64, 4, 3),
        "draft_qkv": C(32, 256, 4, 6),
        "draft_gate_up": C(64, 128, 8, 6),
        "draft_down": C(32, 256, 4, 4),
        "draft_lm_head": C(64, 64, 4, 3),
    }
    for bn, bk, _, stages in got.values():  # num_stages - 1 buffers of a weight chunk and two activation tiles
        assert (stages - 1) * (bk * bn + 2 * G.BLOCK_M * bk) * 2 <= G._SMEM_BUDGET
    assert G.gemv_config(576, 2048, cpu) == C(32, 256, 4, 7)  # K = 2048: 6 of 8 chunks in flight (the budget)
    assert G.gemv_config(576, 2304, cpu, act_tiles=2, itemsize=4) == C(32, 256, 4, 4)  # fp32: 3 of 9
    assert G.gemv_config(576, 100, cpu) == C(32, 128, 4, 1)  # one chunk
    assert G.gemv_config(576, 576, cpu, block_n=32, block_k=64, num_warps=8, num_stages=2) == C(32, 64, 8, 2)


# ------------------------------------------------------------------------------------- GPU, bf16
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_smollm2_and_eagle3_shapes_bf16_on_gpu():
    """Every SmolLM2-135M decode projection and every EAGLE3 draft projection in bf16, compiled: the
    references' roundings, h bit-exact, row 37 of 192 bitwise the same alone (M = 1), at position 5 of 6
    and at position 32 of 48, the lm_heads' argmax (and the draft's d2t offsets) equal to torch.argmax of
    the kernel's y, and replay inside a CUDA graph."""
    cases = [
        ("rmsnorm", 576, 960),
        ("add_rmsnorm", 576, 960),
        ("gemv", 576, 576),
        ("swiglu", 576, 3072),
        ("gemv", 1536, 576),
        ("rmsnorm", 576, 49152),
        ("gemv", 576, 49152),  # target
        ("cat_index", 1152, 960),
        ("cat_rmsnorm", 1152, 960),
        ("swiglu", 576, 1536),
        ("gemv", 768, 576),
        ("rmsnorm", 576, 10240),  # EAGLE3 draft
        ("gemv", 4096, 1024),
    ]  # K > 2048
    for kind, k, n in cases:
        case = _case(kind, 192, k, n, torch.bfloat16, "cuda", bias=False, seed=k + n, k1=576)
        batch = case.run()
        _check(case, batch, torch.bfloat16)
        row = [t[37:38] for t in batch]
        for m, start in ((1, 37), (6, 32), (48, 5)):
            sub = case.sub(slice(start, start + m)).run()
            for got_b, got_m in zip(row, sub):
                assert torch.equal(got_b, got_m[37 - start : 38 - start]), (kind, k, n, m)
        if kind in ARGMAX_KINDS and n >= 10240:
            offsets = torch.randint(0, 1000, (n,), device="cuda")
            ids = case.run(argmax=True, offsets=offsets)[-1]
            want = batch[-1].argmax(-1)
            assert torch.equal(ids, want + offsets[want]), (kind, n)
    case = _case("add_rmsnorm", 1, 576, 960, torch.bfloat16, "cuda", bias=False, seed=1)
    want = case.run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = case.run()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, want))
