"""Triton kernels against their plain-torch references (TRITON_INTERPRET=1 on CPU, real on GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import decode_attention as da

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
    k2[0, :, int(qpos[0].max()) + 1: slots] = 1e4
    assert torch.allclose(da.decode_attention(q, k2, v2, qpos, block_n=32)[0], got[0], atol=1e-5)


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
    from test_model import _prompts, pair
    from engine.generate import Generator
    from engine.sampling import SamplingParams

    _, target = pair()
    target = target.to(device)
    target.init_buffers(torch.device(device))
    prompts = _prompts(3, seed=31)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ref = [r.tokens for r in Generator(target, 3).generate(prompts, params)]
    target.attention_kernel = True
    try:
        assert [r.tokens for r in Generator(target, 3).generate(prompts, params)] == ref
    finally:
        target.attention_kernel = False


def test_triton_attention_needs_cuda(outputs):
    if torch.cuda.is_available():
        pytest.skip("checks the error on a host without CUDA")
    from conftest import compose_cfg
    from pipeline.config import to_run_config
    from pipeline.plan import PlanError, build_plan

    with pytest.raises(PlanError, match=r"model.attention='triton'.*sdpa, or auto"):
        build_plan(to_run_config(compose_cfg("model=tiny", "model.attention=triton", "device=cpu")), outputs)
