"""Small-M GEMV kernels (kernels/gemv.py) against their plain-torch references: TRITON_INTERPRET=1 on
CPU (fp32 and bf16), compiled on a GPU. Also: a row's output does not depend on the batch it is in."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import gemv as G

pytestmark = pytest.mark.skipif(G.triton is None, reason="triton is not installed")
DEVICES = ["cuda"] if torch.cuda.is_available() else (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
KINDS = ["gemv", "add_rmsnorm", "rmsnorm", "silu_mul"]  # rmsnorm: add_rmsnorm_gemv with delta=None
EPS = 1e-5


def _inputs(kind: str, m: int, k: int, n: int, dtype, device, bias: bool, seed: int = 0, row_pad: int = 0):
    """The kernel's arguments. Activations ~N(0, 1), w ~N(0, 1/K): outputs of magnitude ~1. With row_pad,
    the activations are views with row stride K + row_pad (2K + row_pad for gu)."""
    g = torch.Generator().manual_seed(seed)

    def act(cols):
        full = torch.randn(m, cols + row_pad, generator=g).to(device=device, dtype=dtype)
        return full[:, :cols]

    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None
    if kind == "gemv":
        return (act(k), w, b)
    if kind == "silu_mul":
        return (act(2 * k), w, b)
    x = act(k)
    delta = act(k) if kind == "add_rmsnorm" else None
    norm_w = (torch.rand(k, generator=g) + 0.5).to(device=device, dtype=dtype)
    return (x, delta, norm_w, EPS, w, b)


def _rows(kind: str, args, rows: slice) -> tuple:
    """The arguments with the activations (x, delta, gu) cut to `rows`, as fresh tensors; weights as is."""
    acts = (0, 1) if kind == "add_rmsnorm" else (0,)
    return tuple(a[rows].clone() if i in acts else a for i, a in enumerate(args))


def _run(kind: str, args, **kw) -> tuple:
    """-> (y,) or (h, y)"""
    if kind == "gemv":
        return (G.gemv(*args, **kw),)
    if kind == "silu_mul":
        return (G.silu_mul_gemv(*args, **kw),)
    return G.add_rmsnorm_gemv(*args, **kw)


def _reference(kind: str, args) -> tuple:
    if kind == "gemv":
        return (G.gemv_reference(*args),)
    if kind == "silu_mul":
        return (G.silu_mul_gemv_reference(*args),)
    return G.add_rmsnorm_gemv_reference(*args)


def _check(kind: str, args, got: tuple, dtype) -> None:
    want = _reference(kind, args)
    y, ry = got[-1], want[-1]
    assert y.dtype == ry.dtype and y.shape == ry.shape
    if dtype == torch.float32:
        torch.testing.assert_close(y, ry, atol=1e-5, rtol=1e-5)
    else:  # the same roundings as the reference; fp32 sums in another order: within ~1 bf16 ulp
        torch.testing.assert_close(y.float(), ry.float(), atol=2e-2, rtol=1e-2)
    if kind in ("add_rmsnorm", "rmsnorm"):
        assert torch.equal(got[0], want[0])  # h: the residual stream, bit-exact
        if kind == "rmsnorm":
            assert got[0] is args[0]  # delta=None: h is x itself


# ------------------------------------------------------------------------------------- vs reference
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m, bias", [(1, False), (4, True), (6, False), (16, True)])
def test_matches_reference(device, dtype, kind, m, bias):
    # K=100: one masked chunk (BLOCK_K 128); N=21: 6 programs of BLOCK_N 4, the last one ragged
    args = _inputs(kind, m, 100, 21, dtype, device, bias, seed=m)
    _check(kind, args, _run(kind, args), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_k_matches_reference(device, dtype, kind):
    """K > BLOCK_K: the row is walked in chunks (the path for K > MAX_BLOCK_K); 100 = 3 x 32 + a ragged 4."""
    args = _inputs(kind, 3, 100, 9, dtype, device, bias=True, seed=7)
    _check(kind, args, _run(kind, args, block_k=32), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 3])
def test_smollm2_qkv_size(device, m):
    """SmolLM2-135M's fused qkv projection: add + RMSNorm of the hidden 576 -> N = 960 (240 programs)."""
    args = _inputs("add_rmsnorm", m, 576, 960, torch.float32, device, bias=False, seed=11)
    _check("add_rmsnorm", args, _run("add_rmsnorm", args), torch.float32)


# ------------------------------------------------------------------------------------- M-independence
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_k", [None, 32], ids=["one_chunk", "chunked"])
def test_row_is_independent_of_batch(device, dtype, kind, block_k):
    """A row computed alone (M=1) and inside a batch of 6 gives bit-identical outputs (and h)."""
    m = 6
    args = _inputs(kind, m, 96, 13, dtype, device, bias=True, seed=5)
    batch = _run(kind, args, block_k=block_k)
    for i in range(m):
        alone = _run(kind, _rows(kind, args, slice(i, i + 1)), block_k=block_k)
        for got_b, got_1 in zip(batch, alone):
            assert torch.equal(got_b[i:i + 1], got_1), (kind, i)


# ------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_rows(device, kind):
    """Activations as views with a row stride > K (2K for gu): the same bits as contiguous copies."""
    args = _inputs(kind, 4, 64, 10, torch.float32, device, bias=True, seed=3, row_pad=24)
    assert args[0].stride(0) > args[0].shape[1]
    got = _run(kind, args)
    _check(kind, args, got, torch.float32)
    contig = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    for a, b in zip(got, _run(kind, contig)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_are_flattened(device):
    """[b, t, K] in -> [b, t, N] out (as the model's decode / verify activations come)."""
    g = torch.Generator().manual_seed(9)
    x, delta = (torch.randn(2, 3, 64, generator=g).to(device) for _ in range(2))
    norm_w, w = torch.rand(64, generator=g).to(device) + 0.5, torch.randn(40, 64, generator=g).to(device) / 8
    h, y = G.add_rmsnorm_gemv(x, delta, norm_w, EPS, w)
    rh, ry = G.add_rmsnorm_gemv_reference(x, delta, norm_w, EPS, w)
    assert h.shape == (2, 3, 64) and y.shape == (2, 3, 40) and torch.equal(h, rh)
    torch.testing.assert_close(y, ry, atol=1e-5, rtol=1e-5)
    gu = torch.randn(2, 3, 128, generator=g).to(device)
    torch.testing.assert_close(G.silu_mul_gemv(gu, w), G.silu_mul_gemv_reference(gu, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_what_it_does_not_handle(device):
    w = torch.randn(8, 32, device=device)
    with pytest.raises(AssertionError, match="MAX_ROWS"):
        G.gemv(torch.randn(G.MAX_ROWS + 1, 32, device=device), w)
    with pytest.raises(AssertionError, match="contiguous"):
        G.gemv(torch.randn(32, 4, device=device).t(), w)  # unit row stride, not unit column stride
    with pytest.raises(AssertionError, match="expected"):
        G.silu_mul_gemv(torch.randn(2, 32, device=device), w)  # gu must be [M, 2K]


def test_block_sizes_depend_on_the_weight_only():
    """SmolLM2's projections on 132 SMs (the CPU stand-in, as on an H100 / H200): at least one program
    per SM, the register-resident tile within bounds; no M anywhere in the choice."""
    cpu = torch.device("cpu")
    shapes = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "lm_head": (49152, 576)}
    got = {name: G.gemv_config(n, k, cpu) for name, (n, k) in shapes.items()}
    assert got == {"qkv": (4, 1024, 4), "o_proj": (4, 1024, 4), "gate_up": (16, 1024, 8),
                   "down": (4, 2048, 8), "lm_head": (16, 1024, 8)}
    for name, (n, k) in shapes.items():
        bn, bk, _ = got[name]
        assert -(-n // bn) >= 132 and bn * bk <= 16384 and bk >= k


# ------------------------------------------------------------------------------------- GPU, bf16
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_smollm2_shapes_bf16_on_gpu():
    """Every SmolLM2-135M decode projection in bf16, compiled: the references' roundings, h bit-exact,
    rows independent of M, and replay inside a CUDA graph; plus a chunked K (> MAX_BLOCK_K)."""
    cases = [("add_rmsnorm", 576, 960), ("gemv", 576, 576), ("add_rmsnorm", 576, 3072), ("silu_mul", 1536, 576),
             ("gemv", 576, 49152), ("rmsnorm", 576, 49152), ("gemv", 4096, 1024)]
    for kind, k, n in cases:
        full = _inputs(kind, 16, k, n, torch.bfloat16, "cuda", bias=False, seed=k + n)
        batch = _run(kind, full)
        _check(kind, full, batch, torch.bfloat16)
        for m in (1, 6):
            for got_b, got_m in zip(batch, _run(kind, _rows(kind, full, slice(0, m)))):
                assert torch.equal(got_b[:m], got_m), (kind, k, n, m)
    args = _inputs("add_rmsnorm", 1, 576, 960, torch.bfloat16, "cuda", bias=False, seed=1)
    want = _run("add_rmsnorm", args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run("add_rmsnorm", args)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, want))
