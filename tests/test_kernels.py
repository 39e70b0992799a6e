"""Triton kernels against their plain-torch references (TRITON_INTERPRET=1 on CPU, real on GPU)."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from kernels import decode_attention as da
from kernels import fused, gemv, rms_norm, rope, soft_ce, top_p  # noqa: F401  (imported under TRITON_INTERPRET: see below)

pytestmark = pytest.mark.skipif(da.triton is None, reason="triton is not installed")
DEVICES = ["cuda"] if torch.cuda.is_available() else (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b, heads, kv_heads, t, d", [(1, 9, 3, 1, 64), (3, 4, 2, 4, 16), (2, 4, 4, 6, 32)])
def test_decode_attention_matches_reference(device, b, heads, kv_heads, t, d):
    g = torch.Generator().manual_seed(0)
    slots = 200
    q = torch.randn(b, heads, t, d, generator=g).to(device)
    k = torch.randn(b, kv_heads, slots + 1, d, generator=g).to(device)
    v = torch.randn(b, kv_heads, slots + 1, d, generator=g).to(device)
    start = torch.randint(0, 150, (b,), generator=g)  # rows of different lengths, t queries each
    qpos = (start[:, None] + torch.arange(t)[None]).to(device)
    k[:, :, slots:] = float("nan")  # the dummy slot and anything past a row's prefix is never read
    v[:, :, slots:] = float("nan")
    got = da.decode_attention(q, k, v, qpos, block_n=32)
    ref = da.decode_attention_reference(q, k, v, qpos)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-4)
    # a row's output does not depend on slots past its prefix
    k2, v2 = k.clone(), v.clone()
    k2[0, :, int(qpos[0].max()) + 1 : slots] = 1e4
    assert torch.allclose(da.decode_attention(q, k2, v2, qpos, block_n=32)[0], got[0], atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_windowed_decode_attention_reads_only_its_window(device, num_splits):
    """qlo (DFlash's sliding context window): each query attends slots qlo..qpos, whatever the split
    count; a window that starts mid-block, one at slot 0 and a DFlash block (shared qpos, a window per
    query) all match the reference, and the slots below a window are never weighed."""
    g = torch.Generator().manual_seed(1)
    b, heads, kv_heads, t, d, slots = 3, 9, 3, 8, 32, 160
    q = torch.randn(b, heads, t, d, generator=g).to(device)
    k = torch.randn(b, kv_heads, slots + 1, d, generator=g).to(device)
    v = torch.randn(b, kv_heads, slots + 1, d, generator=g).to(device)
    ar = torch.arange(t)
    qpos = torch.stack([130 + ar, 10 + ar, torch.full((t,), 100)]).to(device)  # row 2: a block, non-causal
    own = torch.stack([130 + ar, 10 + ar, 93 + ar]).to(device)  # each query's own position
    qlo = (own - 50 + 1).clamp(min=0)  # a window of 50 positions; row 1 reaches slot 0
    got = da.decode_attention(q, k, v, qpos, block_n=32, num_splits=num_splits, qlo=qlo)
    ref = da.decode_attention_reference(q, k, v, qpos, qlo)
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(got, da.decode_attention(q, k, v, qpos, block_n=32, num_splits=num_splits), atol=1e-3)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, : int(qlo[0].min())] = 1e4  # below row 0's window
    v2[0, :, : int(qlo[0].min())] = 1e4
    again = da.decode_attention(q, k2, v2, qpos, block_n=32, num_splits=num_splits, qlo=qlo)
    assert torch.equal(again, got)


def _split_kv_case(device, dtype, heads, kv_heads, t, d, slots=130, seed=0):
    """Rows of different live lengths: 1 (the first query), one off a block boundary, one of many blocks
    (more than the splits), and a verify row whose last queries are padding (qpos 0, as the engine
    pads). q is the eager path's view: [b, t, heads, d] transposed to [b, heads, t, d]. Also k, v
    with NaN past each row's prefix, which the kernel must never read (the reference would)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, t, heads, d, generator=g).to(device, dtype).transpose(1, 2)
    k = torch.randn(4, kv_heads, slots, d, generator=g).to(device, dtype)
    v = torch.randn(4, kv_heads, slots, d, generator=g).to(device, dtype)
    ar = torch.arange(t)
    qpos = torch.stack([ar, 44 + ar, slots - t - 1 + ar, torch.where(ar < max(1, t // 2), 100 + ar, 0)])
    qpos = qpos.to(device)
    k_nan, v_nan = k.clone(), v.clone()
    for row, n in enumerate(qpos.max(1).values.tolist()):
        k_nan[row, :, n + 1 :] = float("nan")
        v_nan[row, :, n + 1 :] = float("nan")
    return q, k, v, qpos, k_nan, v_nan


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2)])  # GROUP 1, 3, 4
def test_decode_attention_split_kv(device, dtype, t, heads, kv_heads):
    """Split-KV + combine against the reference: block_n 16 over <= 129 live slots is up to 9 blocks,
    so each of 3 splits walks up to 3 blocks, and the short rows leave splits with no live slot."""
    q, k, v, qpos, k_nan, v_nan = _split_kv_case(device, dtype, heads, kv_heads, t, d=16)
    ref = da.decode_attention_reference(q.float(), k.float(), v.float(), qpos)
    got = da.decode_attention(q, k_nan, v_nan, qpos, block_n=16, num_splits=3)
    assert got.dtype == dtype and got.stride() == q.stride()  # q's layout: the caller's reshape is free
    assert torch.isfinite(got).all()
    assert (got.float() - ref).abs().max() < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_split_kv_head_dim_64(device):
    """SmolLM2's shapes (9 heads on 3 kv heads, head_dim 64) in bf16: the default split rule (one split
    per block of the 300 slots here), a split walking several blocks, and a single split."""
    q, k, v, qpos, k_nan, v_nan = _split_kv_case(device, torch.bfloat16, 9, 3, 4, d=64, slots=300, seed=1)
    ref = da.decode_attention_reference(q.float(), k.float(), v.float(), qpos)
    for block_n, num_splits in ((64, None), (32, 2), (64, 1)):
        got = da.decode_attention(q, k_nan, v_nan, qpos, block_n=block_n, num_splits=num_splits)
        assert (got.float() - ref).abs().max() < 2e-2, (block_n, num_splits)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_long_t_is_tiled_over_row_blocks(device):
    """A prefill-length t (GROUP x t = 3 x 40 = 120 rows > MAX_ROWS = 64, the tile for t > SMALL_T) runs
    as several row blocks per kv head, with t a runtime argument: a causal prefill and a second length
    without a new compile. One split (DIRECT): the split path is the same code at any t, tested above
    at small t, and a prefill-length combine is slow to interpret."""
    g = torch.Generator().manual_seed(3)
    for t in (40, 37):
        q = torch.randn(2, 9, t, 16, generator=g).to(device)
        k = torch.randn(2, 3, 64, 16, generator=g).to(device)
        v = torch.randn(2, 3, 64, 16, generator=g).to(device)
        qpos = torch.arange(t).expand(2, t).clone().to(device)
        qpos[1, t // 2 :] = 0  # right padding of a shorter prompt
        ref = da.decode_attention_reference(q, k, v, qpos)
        got = da.decode_attention(q, k, v, qpos, block_n=16, num_splits=1)
        assert (got - ref).abs().max() < 2e-5, t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("programs", [None, 3])
def test_idle_splits_on_a_large_grid_leave_the_workspace_unwritten(device, programs, monkeypatch):
    """With the workspaces poisoned with NaN before the call, short rows in a cache of 8 splits (most of
    them idle, one row's queries live in different splits) match the reference either way. On a small
    grid (a program a split) an idle split writes o = 0; on a large one (LAZY: fewer programs than splits)
    it writes its lse (-inf) alone and the combine reads o only where lse is finite."""
    g = torch.Generator().manual_seed(5)
    b, heads, kv_heads, t, d, slots = 2, 4, 2, 3, 16, 256
    q = torch.randn(b, heads, t, d, generator=g).to(device)
    k = torch.randn(b, kv_heads, slots, d, generator=g).to(device)
    v = torch.randn(b, kv_heads, slots, d, generator=g).to(device)
    qpos = (torch.tensor([5, 30])[:, None] + torch.arange(t)[None]).to(device)  # row 1: slots 30..32 span 2 blocks
    workspaces, empty = [], torch.empty

    def poisoned(*shape, **kw):  # the kernels' fp32 workspaces start as NaN
        x = empty(*shape, **kw)
        if x.dtype == torch.float32 and x.dim() >= 4:
            workspaces.append(x.fill_(float("nan")))
        return x

    monkeypatch.setattr(torch, "empty", poisoned)
    got = da.decode_attention(q, k, v, qpos, block_n=32, programs=programs)
    monkeypatch.undo()
    o_part, lse_part = workspaces  # [b, heads, t, 8, d], [b, heads, t, 8]
    assert torch.allclose(got, da.decode_attention_reference(q, k, v, qpos), atol=2e-5, rtol=1e-4)
    assert torch.isneginf(lse_part[..., 2:]).all()
    assert torch.isfinite(o_part[1, :, 2, 1]).all()  # slot 32 alone
    if programs is None:
        assert (o_part[..., 2:, :] == 0).all() and (o_part[1, :, 0, 1] == 0).all()
    else:
        assert torch.isnan(o_part[..., 2:, :]).all() and torch.isnan(o_part[1, :, 0, 1]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("windowed", [False, True])
def test_fewer_programs_than_splits_give_the_same_bits(device, windowed):
    """A program computing several splits in turn writes each split's partial as its own program would:
    the output is bitwise the same for 1, 3 and 8 programs a tile over 8 splits (rows of different
    lengths, a verify's queries, with and without a sliding window), and the rule keeps a program a
    split up to TARGET_PROGRAMS."""
    g = torch.Generator().manual_seed(6)
    b, heads, kv_heads, t, d, slots = 3, 6, 2, 6, 16, 256
    q = torch.randn(b, heads, t, d, generator=g).to(device)
    k = torch.randn(b, kv_heads, slots, d, generator=g).to(device)
    v = torch.randn(b, kv_heads, slots, d, generator=g).to(device)
    qpos = (torch.tensor([3, 90, 240])[:, None] + torch.arange(t)[None]).to(device)
    qlo = (qpos - 70).clamp(min=0) if windowed else None
    one_each = da.decode_attention(q, k, v, qpos, block_n=32, qlo=qlo, programs=8)
    assert torch.allclose(one_each, da.decode_attention_reference(q, k, v, qpos, qlo), atol=2e-5, rtol=1e-4)
    for programs in (1, 3):
        assert torch.equal(da.decode_attention(q, k, v, qpos, block_n=32, qlo=qlo, programs=programs), one_each)
    assert da.programs_for(3 * 2 * 2, 8) == 8  # batch 3: a program a split
    assert da.programs_for(64 * 3 * 2, 32) == -(-da.TARGET_PROGRAMS // 384) < 32  # batch 64 of SmolLM2, t = 6
    assert da.programs_for(10**6, 32) == 1


def test_decode_attention_num_splits_from_cache_size_only():
    """The grid depends on the cache size only (a captured graph replays it as sequences grow, and a
    row's split, hence its bits, is the same in any batch, eager or captured): one split per block of
    the cache, at most MAX_SPLITS."""
    assert list(inspect.signature(da.num_splits_for).parameters) == ["slots", "block_n"]
    assert da.num_splits_for(2049, 64) == da.MAX_SPLITS == 32
    assert da.num_splits_for(1025, 64) == 17
    assert da.num_splits_for(100, 64) == 2  # no more splits than blocks
    assert da.num_splits_for(64, 64) == 1  # one block: DIRECT, no combine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_row_is_independent_of_batch_and_t(device, dtype):
    """A (batch row, query)'s output is bitwise the same computed as a decode (t = 1, batch 1, with NaN
    past its prefix), as one of a verify's 6 queries (same qpos), and beside 3 other batch rows of other
    lengths: the split count comes from the cache, and decode and verify share one row tile shape.
    GROUP 3 as SmolLM2's (a verify's 18 rows per kv head span two row tiles of 16); 128 slots in blocks
    of 32 (the default rule: 4 splits), row 1's live lengths 71..76 ending inside a block."""
    g = torch.Generator().manual_seed(4)
    b, heads, kv_heads, t, d, slots = 4, 6, 2, 6, 32, 128
    q = torch.randn(b, heads, t, d, generator=g).to(device, dtype)
    k = torch.randn(b, kv_heads, slots, d, generator=g).to(device, dtype)
    v = torch.randn(b, kv_heads, slots, d, generator=g).to(device, dtype)
    qpos = (torch.tensor([7, 70, 20, 100])[:, None] + torch.arange(t)[None]).to(device)
    batch = da.decode_attention(q, k, v, qpos, block_n=32)  # [4, 6, 6, 32]
    alone = da.decode_attention(q[1:2], k[1:2], v[1:2], qpos[1:2], block_n=32)  # the verify alone
    assert torch.equal(batch[1:2], alone)
    for i in (0, 4):  # queries as decode steps: nothing past a query's own position is written yet
        k1, v1 = k[1:2].clone(), v[1:2].clone()
        k1[:, :, int(qpos[1, i]) + 1 :] = float("nan")
        v1[:, :, int(qpos[1, i]) + 1 :] = float("nan")
        step = da.decode_attention(q[1:2, :, i : i + 1].contiguous(), k1, v1, qpos[1:2, i : i + 1], block_n=32)
        assert torch.equal(step, batch[1:2, :, i : i + 1]), i
    ref = da.decode_attention_reference(q.float(), k.float(), v.float(), qpos)
    assert (batch.float() - ref).abs().max() < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_bf16(device):
    if device == "cpu":
        pytest.skip("bf16 is checked on the GPU")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(8, 9, 4, 64, generator=g).to(device, torch.bfloat16)
    k = torch.randn(8, 3, 2049, 64, generator=g).to(device, torch.bfloat16)
    v = torch.randn(8, 3, 2049, 64, generator=g).to(device, torch.bfloat16)
    qpos = (torch.randint(0, 1500, (8,), generator=g)[:, None] + torch.arange(4)[None]).to(device)
    ref = da.decode_attention_reference(q.float(), k.float(), v.float(), qpos)
    assert (da.decode_attention(q, k, v, qpos).float() - ref).abs().max() < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_model_with_the_kernel_equals_sdpa(device):
    """The target's decode and verify forwards through the kernel equal the SDPA path, and so does
    greedy speculative generation (the kernel reads each row's live prefix only)."""
    from helpers.models import pair, random_prompts

    from engine.sampling import SamplingParams
    from engine.speculative.generate import Generator

    _, target = pair(max_seq_len=64)  # 65 slots: two blocks of 64, split and combined
    target = target.to(device)
    target.init_buffers(torch.device(device))
    prompts = random_prompts(3, seed=245)  # 6, 7 and 10 tokens: short interpreted prefills, rows of different lengths
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = [r.tokens for r in Generator(target, 3).generate(prompts, params)]
    target.attention_kernel = True
    try:
        assert [r.tokens for r in Generator(target, 3).generate(prompts, params)] == ref
    finally:
        target.attention_kernel = False


def test_triton_kernels_need_cuda(outputs, monkeypatch):
    """(triton.jit picks the interpreter when a module is imported: every kernel module this file tests is
    imported at the top, so the plan built here without TRITON_INTERPRET cannot import one compiled.)"""
    if torch.cuda.is_available():
        pytest.skip("checks the error on a host without CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from helpers.runs import compose_cfg

    from pipeline.config import to_run_config
    from pipeline.plan import PlanError, build_plan

    with pytest.raises(PlanError, match=r"model.attention='triton'.*sdpa, or auto"):
        build_plan(to_run_config(compose_cfg("model=tiny", "model.attention=triton", "device=cpu")), outputs)
    with pytest.raises(PlanError, match=r"model.fused=True.*needs triton and a CUDA device"):
        build_plan(to_run_config(compose_cfg("model=tiny", "model.fused=true", "device=cpu")), outputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rmsnorm_matches_reference(device, with_delta):

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 96, generator=g).to(device)
    delta = torch.randn(5, 3, 96, generator=g).to(device) if with_delta else None
    w = torch.rand(96, generator=g).to(device) + 0.5
    h, y = fused.add_rmsnorm(x, delta, w, 1e-5)
    rh, ry = fused.add_rmsnorm_reference(x, delta, w, 1e-5)
    assert torch.allclose(h, rh, atol=1e-6) and torch.allclose(y, ry, atol=1e-5)
    from engine.model import RMSNorm  # the model's module is the reference's definition too

    norm = RMSNorm(96, 1e-5).to(device)
    norm.weight.data.copy_(w)
    assert torch.allclose(norm(rh), ry, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads, kv, d", [(4, 2, 16), (9, 3, 64)])  # a power of two; SmolLM2's 12 heads
def test_rope_cache_write_matches_reference(device, heads, kv, d):

    g = torch.Generator().manual_seed(3)
    b, t, slots = 2, 3, 40
    qkv = torch.randn(b, t, (heads + 2 * kv) * d, generator=g).to(device)
    ang = torch.rand(slots + 1, d // 2, generator=g).to(device) * 6  # tables over positions 0..40
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    slot = torch.tensor([[5, 6, 40], [0, 1, 2]], device=device)  # 40: the dummy slot
    pos = torch.tensor([[5, 6, 0], [17, 1, 33]], device=device)  # RoPE rows need not be the slots
    caches = [torch.zeros(b, kv, slots + 1, d, device=device) for _ in range(4)]
    q = fused.rope_cache_write(qkv, cos, sin, pos, slot, caches[0], caches[1], heads, kv)
    rq = fused.rope_cache_write_reference(qkv, cos, sin, pos, slot, caches[2], caches[3], heads, kv)
    assert torch.allclose(q, rq, atol=1e-5)
    assert torch.allclose(caches[0], caches[2], atol=1e-5) and torch.allclose(caches[1], caches[3], atol=1e-6)
    assert caches[0].abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [4, 0], ids=["q-and-k", "k-only"])  # k only: DFlash's context write
def test_rope_cache_write_norms_each_q_and_k_head_like_the_module(device, dtype, heads):
    """Qwen3's q/k norms in the kernel: each head RMS-normed (weight [d]) before RoPE, as the reference and
    the model's own RMSNorm over [b, t, heads, d] compute it; a token's result never reads its neighbours."""
    from engine.model import RMSNorm

    g = torch.Generator().manual_seed(4)
    b, t, kv, d, slots = 3, 2, 2, 32, 12
    qkv = (torch.randn(b, t, (heads + 2 * kv) * d, generator=g) * 3).to(device, dtype)
    ang = torch.rand(slots + 1, d // 2, generator=g).to(device) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    pos = torch.tensor([[1, 2], [5, 6], [3, 11]], device=device)  # also each token's slot
    qn = (1 + 0.3 * torch.randn(d, generator=g)).to(device, dtype) if heads else None
    kn = (1 + 0.3 * torch.randn(d, generator=g)).to(device, dtype)
    caches = [torch.zeros(b, kv, slots + 1, d, device=device, dtype=dtype) for _ in range(6)]
    q = fused.rope_cache_write(qkv, cos, sin, pos, pos, caches[0], caches[1], heads, kv, qn, kn, 1e-6)
    rq = fused.rope_cache_write_reference(qkv, cos, sin, pos, pos, caches[2], caches[3], heads, kv, qn, kn, 1e-6)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q, rq, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    assert torch.equal(caches[1], caches[3])  # v is copied, never normed
    norm = RMSNorm(d, 1e-6).to(device, dtype)
    norm.weight.data.copy_(kn)
    k = norm(qkv[..., heads * d : (heads + kv) * d].reshape(b, t, kv, d)).float().transpose(1, 2)  # [b, kv, t, d]
    c, s = cos[pos][:, None], sin[pos][:, None]  # [b, 1, t, d]
    written = caches[2].gather(2, pos[:, None, :, None].expand(b, kv, t, d))  # [b, kv, t, d]
    torch.testing.assert_close(written, (k * c + fused.rotate_half(k) * s).to(dtype), **tol)
    one = fused.rope_cache_write(
        qkv[1:2], cos, sin, pos[1:2], pos[1:2], caches[4][1:2], caches[5][1:2], heads, kv, qn, kn, 1e-6
    )
    assert torch.equal(one, q[1:2]) and torch.equal(caches[4][1], caches[0][1])  # per token: batch-invariant


@pytest.mark.parametrize("device", DEVICES)
def test_fused_model_equals_unfused(device):
    """The whole target through the fused kernels (norm, RoPE + cache write, SwiGLU, fused
    projections) and the attention kernel: same logits, aux states and greedy output."""
    from helpers.models import pair, random_prompts

    from engine.sampling import SamplingParams
    from engine.speculative.generate import Generator

    _, target = pair(max_seq_len=64)  # 65 slots: two blocks of 64, split and combined
    target = target.to(device)
    target.init_buffers(torch.device(device))
    target.set_aux_layers([1, 3])
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5)).to(device)
    pos = torch.arange(9, device=device).expand(2, 9)
    ref = target(ids, pos, target.new_cache(2), kv_len=9)
    prompts = random_prompts(3, seed=381)  # 5, 9 and 6 tokens
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref_tokens = [r.tokens for r in Generator(target, 3).generate(prompts, params)]
    target.attention_kernel = True
    target.use_fused_kernels()
    got = target(ids, pos, target.new_cache(2), kv_len=9)
    assert torch.allclose(got.logits, ref.logits, atol=1e-4)
    assert torch.allclose(got.aux_hidden_states, ref.aux_hidden_states, atol=1e-4)
    assert [r.tokens for r in Generator(target, 3).generate(prompts, params)] == ref_tokens


@pytest.mark.parametrize("device", DEVICES)
def test_batch_invariant_off_sends_large_decode_steps_to_cublas(device, monkeypatch):
    """set_batch_invariant(False): a decode step of more than THROUGHPUT_ROWS rows runs no rows kernel
    and one attention split (self-distillation's batches), smaller steps still run the batch-invariant
    kernels, and the logits agree with theirs.
    Turned back on, the rows kernels run at any row count again, bitwise as before."""
    from helpers.models import pair

    import engine.model as model_mod
    import engine.ops as ops_mod

    _, target = pair(max_seq_len=64)  # 65 slots: two splits by default, one in throughput mode
    target = target.to(device)
    target.init_buffers(torch.device(device))
    target.attention_kernel = True
    target.use_fused_kernels()
    monkeypatch.setattr(model_mod, "THROUGHPUT_ROWS", 2)  # a small limit: interpreted kernels are slow
    calls, splits = [], []
    real, real_attention = ops_mod.add_rmsnorm_gemv, model_mod.decode_attention
    monkeypatch.setattr(ops_mod, "add_rmsnorm_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(
        model_mod, "decode_attention", lambda *a, **k: splits.append(k.get("num_splits")) or real_attention(*a, **k)
    )

    def step(rows: int):  # one decode step of `rows` rows after a 5-token prefill
        g = torch.Generator().manual_seed(rows)
        ids = torch.randint(0, 256, (rows, 6), generator=g).to(device)
        cache = target.new_cache(rows)
        target(ids[:, :5], torch.arange(5, device=device).expand(rows, 5), cache, kv_len=5)
        calls.clear(), splits.clear()
        out = target(ids[:, 5:], torch.full((rows, 1), 5, device=device), cache, kv_len=6).logits
        return out, len(calls), set(splits)

    big = model_mod.THROUGHPUT_ROWS + 1  # (3 rows: a prefill of 15 fused rows, not 30 normalised one by one)
    ref, n_ref, s_ref = step(big)
    target.set_batch_invariant(False)
    fast, n_fast, s_fast = step(big)
    _, n_small, s_small = step(model_mod.THROUGHPUT_ROWS)
    target.set_batch_invariant(True)
    again, _, _ = step(big)
    assert n_ref > 0 and n_fast == 0 and n_small == n_ref
    assert s_ref == s_small == {None} and s_fast == {1}  # the cache's split count, or one split per program
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(again, ref)


# ------------------------------------------------------------------------------------- soft cross-entropy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [37, 1024, 2500])  # one partial block, one whole block, several blocks
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_soft_cross_entropy_matches_reference(device, dtype, v, temperature):
    g = torch.Generator().manual_seed(v)
    z = (3 * torch.randn(6, v, generator=g)).to(device, dtype).requires_grad_(True)
    t = (3 * torch.randn(6, v, generator=g)).to(device, dtype)
    rows = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool, device=device)
    w = torch.randn(6, generator=g).to(device)
    for r in (None, rows):
        got = {}
        for kernel in ("torch", "triton"):
            ce, arg = soft_ce.soft_cross_entropy(z, t, temperature, r, kernel)
            (ce * w).sum().backward()
            got[kernel] = ce.detach(), arg, z.grad
            z.grad = None
        (ce0, arg0, g0), (ce1, arg1, g1) = got["torch"], got["triton"]
        assert ce1.dtype == torch.float32 and g1.dtype == dtype
        torch.testing.assert_close(ce1, ce0, atol=2e-5, rtol=1e-5)
        assert torch.equal(arg1, arg0)
        torch.testing.assert_close(g1.float(), g0.float(), atol=1e-6 if dtype == torch.float32 else 8e-3, rtol=1e-4)
        if r is not None:  # dead rows: no loss, no gradient, no argmax
            assert not ce1[~r].any() and not g1[~r].any() and (arg1[~r] == -1).all()
    # the cross-entropy against the target's own distribution is its entropy: the minimum over logits
    ce_self, _ = soft_ce.soft_cross_entropy(t.float(), t.float(), 1.0, None, "triton")
    p = t.float().softmax(-1)
    torch.testing.assert_close(ce_self, -(p * p.log()).sum(-1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_soft_cross_entropy_dead_rows_with_large_logits_get_a_zero_gradient(device):
    """Dead rows are real positions too (a prompt's, a TTT step's first ones) with the target's real logits:
    at T = 0.5 a logit of 45 is exp(90), past fp32. The backward must not touch them (0 * inf is NaN: the
    first GPU training run with the kernel went NaN at its first steps)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 2500, generator=g).to(device).requires_grad_(True)
    t = torch.randn(4, 2500, generator=g).to(device)
    with torch.no_grad():
        t[1] += 60.0  # dead
        z[3] += 120.0  # dead
        t[2] += 60.0  # live: its own logsumexp keeps it finite
    rows = torch.tensor([1, 0, 1, 0], dtype=torch.bool, device=device)
    got = {}
    for kernel in ("torch", "triton"):
        ce, _ = soft_ce.soft_cross_entropy(z, t, 0.5, rows, kernel)
        ce.sum().backward()
        got[kernel], z.grad = (ce.detach(), z.grad), None
    (ce0, g0), (ce1, g1) = got["torch"], got["triton"]
    assert torch.isfinite(g1).all() and not g1[~rows].any()
    torch.testing.assert_close(ce1, ce0, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(g1, g0, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_soft_cross_entropy_argmax_takes_the_first_maximum_across_blocks(device):
    z = torch.zeros(2, 3000, device=device)
    z[0, 1500] = z[0, 2900] = z[0, 2000] = 5.0  # ties in two later blocks: the first index wins
    z[1, 7] = z[1, 1030] = 1.0
    _, arg = soft_ce.soft_cross_entropy(z, z, 1.0, None, "triton")
    assert arg.tolist() == [1500, 7] == z.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v", [37, 2500])  # one partial block; several blocks and a partial one
def test_linear_soft_cross_entropy_matches_the_lm_head_then_the_reference(device, v):
    """The fused lm_head + loss forms hidden's gradient in its forward (the logits overwritten in place):
    its loss, cross-entropies, argmax and gradient equal the reference's over the formed logits, and an
    incoming gradient other than 1 (a rank's share of the batch) scales the gradient."""
    g = torch.Generator().manual_seed(v)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    weight = (torch.randn(v, 48, generator=g) / 4).to(device, dtype)  # [V, H], frozen
    target = (3 * torch.randn(9, v, generator=g)).to(device, dtype)  # every position's target logits
    index = torch.tensor([7, 0, 3, 3, 8], device=device)
    hidden = torch.randn(5, 48, generator=g).to(device).requires_grad_(True)  # fp32, like the final norm's
    got = {}
    for kernel in ("torch", "triton"):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            loss, ce, arg = soft_ce.linear_soft_cross_entropy(hidden, weight, target, 0.5, index, 0.3, kernel)
        (2.5 * loss).backward()
        got[kernel], hidden.grad = (loss.detach(), ce, arg, hidden.grad), None
    (l0, ce0, a0, g0), (l1, ce1, a1, g1) = got["torch"], got["triton"]
    torch.testing.assert_close(l0, 0.3 * ce0.sum())
    assert not ce1.requires_grad and g1.dtype == torch.float32
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(ce1, ce0, **tol)
    torch.testing.assert_close(l1, 0.3 * ce0.sum(), **tol)
    assert torch.equal(a1, a0)
    torch.testing.assert_close(g1, g0, **(tol if dtype == torch.float32 else dict(atol=5e-3, rtol=2e-2)))
    assert g1.abs().sum() > 0
    with pytest.raises(ValueError, match="index"):
        soft_ce.linear_soft_cross_entropy(hidden, weight, target, 1.0, index[:3], 1.0, "torch")
    with pytest.raises(ValueError, match="frozen"):
        soft_ce.linear_soft_cross_entropy(hidden, weight.requires_grad_(True), target, 1.0, index, 1.0, "torch")


def test_soft_cross_entropy_rejects_a_bad_kernel_or_shape():
    z = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="kernel='fused'"):
        soft_ce.soft_cross_entropy(z, z, 1.0, None, "fused")
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        soft_ce.soft_cross_entropy(z, z[:, :4], 1.0, None, "torch")


# ------------------------------------------------------------------------------------- RMSNorm with a backward
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, out_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16)]
)
@pytest.mark.parametrize("rows, hidden", [(37, 576), (5, 100)])  # SmolLM2's width; rows past a whole program
def test_rms_norm_forward_and_backward_match_reference(device, dtype, out_dtype, rows, hidden):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 is checked on the GPU (the interpreter truncates fp32 -> bf16 casts)")
    from kernels import rms_norm as rn

    g = torch.Generator().manual_seed(rows)
    x = (2 * torch.randn(rows, hidden, generator=g)).to(device, dtype).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device).requires_grad_(True)
    dy = torch.randn(rows, hidden, generator=g).to(device)
    got = {}
    for kernel in ("torch", "triton"):
        y = rn.rms_norm(x, w, 1e-5, out_dtype, kernel)
        (y.float() * dy).sum().backward()
        got[kernel] = y.detach(), x.grad, w.grad
        x.grad = w.grad = None
    (y0, dx0, dw0), (y1, dx1, dw1) = got["torch"], got["triton"]
    assert y1.dtype == y0.dtype == (out_dtype or torch.float32) and dx1.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(y1.float(), y0.float(), **tol)
    torch.testing.assert_close(dx1.float(), dx0.float(), **tol)
    torch.testing.assert_close(
        dw1, dw0, atol=1e-4 if dtype == torch.float32 else 0.3, rtol=1e-4 if dtype == torch.float32 else 2e-2
    )


# ------------------------------------------------------------------------------------- RoPE with a backward
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads, d", [(9, 64), (3, 64), (4, 16)])  # SmolLM2's q and kv heads; a power of two
def test_rope_forward_and_backward_match_reference(device, heads, d):
    from kernels import rope as rp

    g = torch.Generator().manual_seed(heads)
    b, t = 2, 5
    x = torch.randn(b, t, heads * d, generator=g).to(device).requires_grad_(True)
    ang = torch.rand(b, t, d // 2, generator=g).to(device) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    dy = torch.randn(b, heads, t, d, generator=g).to(device)
    got = {}
    for kernel in ("torch", "triton"):
        y = rp.rope(x, cos, sin, heads, None, kernel)
        (y * dy).sum().backward()
        got[kernel] = y.detach(), x.grad
        x.grad = None
    (y0, dx0), (y1, dx1) = got["torch"], got["triton"]
    assert y1.shape == (b, heads, t, d) and y1.is_contiguous() and dx1.shape == x.shape
    torch.testing.assert_close(y1, y0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx1, dx0, atol=1e-5, rtol=1e-5)
    # the rotation keeps each pair's norm, and the backward is its inverse
    torch.testing.assert_close(y1.square().sum(), x.detach().square().sum(), rtol=1e-5, atol=1e-3)


# ------------------------------------------------------------------------------------- top-p without a sort
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v", [37, 3000])  # one partial block; several blocks
def test_top_p_threshold_keeps_the_sorted_nucleus(device, v):
    """The searched threshold keeps exactly the sort's nucleus: scalar and per-row top-p, flat and peaked
    rows (one token past top_p alone), and every token at top_p = 1."""
    g = torch.Generator().manual_seed(v)
    logits = 3 * torch.randn(6, v, generator=g)
    logits[1, 5] = 40.0  # one token holds nearly all the mass
    logits[2] = 0.01 * torch.randn(v, generator=g)  # nearly flat
    probs = logits.softmax(-1).to(device)
    per_row = torch.tensor([[0.1], [0.5], [0.9], [0.99], [1.0], [0.3]], device=device)
    for p in (0.5, 0.95, per_row):
        tau = top_p.top_p_threshold(probs, p)
        kept = probs >= tau[:, None]
        assert torch.equal(kept, top_p.top_p_filter_reference(probs, p) > 0)
        mass = (probs * kept).sum(-1)
        assert (mass >= (p.flatten() if isinstance(p, torch.Tensor) else p) - 1e-6).all()
    assert kept[4].all() and kept[1].sum() == 1  # top_p = 1: everything; the peaked row: its one token
    with pytest.raises(ValueError, match="float32"):
        top_p.top_p_threshold(probs.double(), 0.5)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs Hopper or later"
)
def test_dependent_launches_change_no_bit():
    """The fused target's step captured in a CUDA graph with programmatic dependent launch (each kernel
    launched while the one before drains, its weight prefetched into L2) replays the bits of the same
    step captured with plain launches: a 1-token decode and a 6-token verify-shaped step over 8 rows."""
    from helpers.models import pair

    from kernels.runtime import pdl, set_pdl

    _, target = pair(max_seq_len=64)
    target = target.to("cuda")
    target.init_buffers(torch.device("cuda"))
    target.attention_kernel = True
    target.use_fused_kernels()
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 256, (8, 9), generator=g).cuda()  # [8, 9]

    def replayed(on: bool, t: int) -> torch.Tensor:
        set_pdl(on)
        assert pdl(torch.device("cuda")) == on
        cache = target.new_cache(8)
        target(prompt, torch.arange(9, device="cuda").expand(8, 9), cache, kv_len=9)
        ids = torch.randint(0, 256, (8, t), generator=torch.Generator().manual_seed(t)).cuda()  # [8, t]
        pos = torch.arange(9, 9 + t, device="cuda").expand(8, t)
        target(ids, pos, cache, kv_len=9 + t)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = target(ids, pos, cache, kv_len=9 + t)
        graph.replay()
        torch.cuda.synchronize()
        return out.logits.clone()  # [8, t, vocab]

    old = set_pdl(False)
    try:
        for t in (1, 6):
            assert torch.equal(replayed(True, t), replayed(False, t)), t
    finally:
        set_pdl(old)
