"""Counter-based sampling (kernels/sample.py): Philox bits as triton computes them, the sampling and
acceptance kernels against their plain-torch references (TRITON_INTERPRET=1 on CPU), random numbers that
depend on the row alone, and draws distributed as the target's p (chi-square)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.stats import chi_square_ok

from kernels.runtime import triton
from kernels.sample import (
    ACCEPT,
    BONUS,
    DRAFT,
    accept,
    accept_reference,
    philox_reference,
    sample,
    sample_reference,
    uniform_reference,
)

CUDA = torch.cuda.is_available()
KERNELS = triton is not None and (CUDA or os.environ.get("TRITON_INTERPRET") == "1")
DEVICE = "cuda" if CUDA else "cpu"
needs_kernels = pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")

if KERNELS:
    import triton.language as tl

    from kernels.sample import _uniform

    @triton.jit
    def _philox_words(SEED, POS, OUT, BLOCK: tl.constexpr):
        """OUT [rows, BLOCK, 4]: tl.philox's words of (seed, v, position, 2, 0) for v = 0..BLOCK-1."""
        r = tl.program_id(0)
        v = tl.arange(0, BLOCK)
        zero = v.to(tl.uint32) * 0
        w0, w1, w2, w3 = tl.philox(
            tl.load(SEED + r), v.to(tl.uint32), zero + tl.load(POS + r).to(tl.uint32), zero + 2, zero
        )
        out = OUT + (r * BLOCK + v) * 4
        tl.store(out, w0.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out + 1, w1.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out + 2, w2.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out + 3, w3.to(tl.int64) & 0xFFFFFFFF)

    @triton.jit
    def _uniforms(SEED, POS, OUT, STREAM: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        v = tl.arange(0, BLOCK)
        tl.store(OUT + r * BLOCK + v, _uniform(tl.load(SEED + r), tl.load(POS + r), STREAM, v))


def _rows(g: torch.Generator, temperature: list[float], top_p: list[float]):
    b = len(temperature)
    seed = torch.randint(-(2**62), 2**62, (b,), generator=g)
    return torch.tensor(temperature), torch.tensor(top_p), seed


# ------------------------------------------------------------------------------------------ random bits
def test_philox_reference_is_philox4x32_10():
    """Random123's known answer (key 0, counter 0), and the reference's words for counters and keys that
    use every bit (negative seeds, positions past 2^31) equal triton's tl.philox."""
    zero = torch.zeros((), dtype=torch.long)
    assert [int(w) for w in philox_reference(zero, zero, zero, zero, zero)] == [
        0x6627E8D5,
        0xE169C58D,
        0xBC57AC4C,
        0x9B00DBD8,
    ]
    if not KERNELS:
        return
    seed = torch.tensor([0, 1, -5, 2**62 + 12345, -(2**63)], device=DEVICE)
    pos = torch.tensor([0, 7, 123456, 2**31 + 5, 2**32 - 1], device=DEVICE)
    got = torch.zeros(5, 32, 4, dtype=torch.long, device=DEVICE)
    _philox_words[(5,)](seed, pos, got, BLOCK=32)
    v = torch.arange(32, device=DEVICE)
    want = torch.stack(philox_reference(seed[:, None], v, pos[:, None], 2, 0), -1)
    assert torch.equal(got, want)


@needs_kernels
def test_the_kernels_uniforms_are_the_references_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    seed = torch.randint(-(2**63), 2**63 - 1, (6,), generator=g).to(DEVICE)
    pos = torch.randint(0, 2**32, (6,), generator=g).to(DEVICE)
    for stream in (DRAFT, ACCEPT, BONUS):
        got = torch.empty(6, 64, device=DEVICE)
        _uniforms[(6,)](seed, pos, got, STREAM=stream, BLOCK=64)
        want = uniform_reference(seed, pos, stream, torch.arange(64, device=DEVICE))
        assert torch.equal(got, want) and 0 < want.min() and want.max() < 1


def test_a_rows_random_numbers_depend_on_its_seed_position_and_stream_alone():
    """The same (seed, position) gives the same numbers as row 0 of one and row 3 of five; another seed,
    position or stream gives others."""
    seed, pos, idx = torch.tensor([11, 5, -3, 11, 9]), torch.tensor([40, 2, 40, 40, 41]), torch.arange(50)
    batch = uniform_reference(seed, pos, DRAFT, idx)  # [5, 50]
    alone = uniform_reference(seed[3:4], pos[3:4], DRAFT, idx)
    assert torch.equal(batch[3], alone[0]) and torch.equal(batch[0], batch[3])
    assert not torch.equal(batch[2], batch[3]) and not torch.equal(batch[4], batch[3])  # seed, position
    assert not torch.equal(uniform_reference(seed[3:4], pos[3:4], BONUS, idx)[0], alone[0])  # stream


# ------------------------------------------------------------------------------------------ kernels
SETTINGS = ([0.0, 0.7, 1.0, 0.7, 1.3, 0.0], [1.0, 0.9, 1.0, 0.5, 0.95, 0.9])  # greedy, top-p and plain rows


@needs_kernels
@pytest.mark.parametrize("indexed", [False, True])
def test_sample_kernel_equals_its_reference(indexed):
    """Ids bitwise (greedy rows: the argmax; a vocabulary of two chunks; bf16 logits, whose ties the
    nucleus keeps whole), q of the sampled rows to fp32 rounding, greedy rows' q untouched; indexed:
    one t-index per row, ids mapped by offsets."""
    g = torch.Generator().manual_seed(1)
    b, t, v = 6, 2, 1100
    logits = (torch.randn(b, t, v, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    temp, top_p, seed = (x.to(DEVICE) for x in _rows(g, *SETTINGS))
    pos0 = torch.randint(0, 500, (b,), generator=g).to(DEVICE)
    index = torch.randint(0, t, (b,), generator=g).to(DEVICE) if indexed else None
    offsets = torch.randint(0, 9, (v,), generator=g).to(DEVICE) if indexed else None
    qs = [torch.full((b, 1 if indexed else t, v), -1.0, device=DEVICE) for _ in range(2)]
    got = sample(logits, temp, top_p, seed, pos0, DRAFT, index=index, q_out=qs[0], offsets=offsets)
    want = sample_reference(logits, temp, top_p, seed, pos0, DRAFT, index=index, q_out=qs[1], offsets=offsets)
    assert torch.equal(got, want)
    torch.testing.assert_close(qs[0], qs[1], atol=1e-6, rtol=1e-5)
    assert (qs[0][temp == 0] == -1).all() and torch.allclose(qs[0][temp > 0].sum(-1), torch.ones(1, device=DEVICE))
    plain = logits[torch.arange(b), index] if indexed else logits[:, 0]
    greedy = plain.float().argmax(-1) + (offsets[plain.float().argmax(-1)] if indexed else 0)
    assert torch.equal(got[temp == 0, 0], greedy[temp == 0])


@needs_kernels
@pytest.mark.parametrize("q_kind", ["draft_vocab", "full_vocab", "one_hot"])
def test_accept_kernel_equals_its_reference(q_kind):
    """The out rows bitwise: greedy rows (the greedy rule), an opted-out row (a = 0), sampled rows with
    and without top-p against a q near p (so both acceptances and rejections happen), q over a draft
    vocabulary (vocab_map), the target's, or one-hot (host drafts)."""
    g = torch.Generator().manual_seed(2)
    b, k, v = 6, 3, 1100
    logits = (torch.randn(b, k + 1, v, generator=g) * 2).to(torch.bfloat16)
    temp, top_p, seed = _rows(g, [0.0, 0.7, 1.0, 0.7, 1.0, 0.9], [1.0, 0.9, 1.0, 0.5, 1.0, 0.8])
    speculate = torch.tensor([True] * 4 + [False, True])
    inv_t = 1 / temp.clamp_min(0.5)
    near = torch.softmax(logits[:, :k].float() * inv_t[:, None, None] + torch.randn(b, k, v, generator=g) * 0.3, -1)
    draft = torch.multinomial(near.view(-1, v), 1, generator=g).view(b, k)
    draft[0] = logits[0, :k].float().argmax(-1)  # greedy row 0 accepts every draft
    vocab_map, q = None, None
    if q_kind == "full_vocab":
        q = near
    elif q_kind == "draft_vocab":  # the draft's vocabulary: the drafts and a random 1000 of the rest
        used = torch.unique(torch.cat([draft.view(-1), torch.randperm(v, generator=g)[:700]]))
        vocab_map = torch.full((v,), -1, dtype=torch.int32)
        vocab_map[used] = torch.arange(len(used), dtype=torch.int32)
        q = near[..., used] / near[..., used].sum(-1, keepdim=True)
    lengths = torch.randint(3, 300, (b,), generator=g)
    args = [x.to(DEVICE) if x is not None else None for x in (logits, draft, q, vocab_map, temp, top_p, seed, lengths)]
    outs = [torch.full((b, k + 4), -7, dtype=torch.long, device=DEVICE) for _ in range(2)]
    a, bonus = accept(*args, speculate.to(DEVICE), outs[0])
    ra, rbonus = accept_reference(*args, speculate.to(DEVICE), outs[1])
    assert torch.equal(outs[0], outs[1]) and torch.equal(bonus, rbonus) and torch.equal(a, ra)
    assert a[0] == k and a[4] == 0  # greedy row 0, the opted-out row 4
    if q_kind != "one_hot":
        sampled = a[temp.to(DEVICE) > 0]
        assert (sampled > 0).any() and (sampled < k).any()  # accepts and rejections


@needs_kernels
def test_a_round_without_drafts_accepts_nothing_and_draws_what_sample_draws():
    """k = 0 (plain decoding): the kernel equals its reference, and the bonus is `sample`'s draw of p_0 at
    the next position (BONUS stream): what plain decoding and an opted-out row emit."""
    g = torch.Generator().manual_seed(3)
    b, v = 6, 1200
    logits = (torch.randn(b, 1, v, generator=g) * 2).to(DEVICE)
    temp, top_p, seed = (x.to(DEVICE) for x in _rows(g, *SETTINGS))
    lengths = torch.randint(3, 300, (b,), generator=g).to(DEVICE)
    draft, spec = torch.empty(b, 0, dtype=torch.long, device=DEVICE), torch.ones(b, dtype=torch.bool, device=DEVICE)
    out = torch.zeros(b, 2, dtype=torch.long, device=DEVICE)
    a, bonus = accept(logits, draft, None, None, temp, top_p, seed, lengths, spec, out)
    ra, rbonus = accept_reference(logits, draft, None, None, temp, top_p, seed, lengths, spec, out.clone())
    assert torch.equal(bonus, rbonus) and (a == 0).all() and (ra == 0).all()
    assert torch.equal(bonus, sample(logits, temp, top_p, seed, lengths + 1, BONUS)[:, 0])


def test_draws_are_distributed_as_p_with_temperature_and_top_p():
    """20000 seeds, T = 0.7, top-p 0.9: the race's draws pass a chi-square test against p (the nucleus
    renormalised); the tokens outside the nucleus never appear."""
    n, v = 20000, 12
    z = torch.randn(v, generator=torch.Generator().manual_seed(4)) * 1.5
    ones = torch.ones(n)
    ids = sample_reference(z.expand(n, 1, v), 0.7 * ones, 0.9 * ones, torch.arange(n), torch.full((n,), 17), BONUS)
    p = torch.softmax(z / 0.7, -1)
    ranked, order = p.sort(descending=True)
    keep = torch.zeros(v, dtype=torch.bool)
    keep[order[(ranked.cumsum(0) - ranked) < 0.9]] = True
    want = torch.where(keep, p, 0) / p[keep].sum()
    ok, stat, crit = chi_square_ok(torch.bincount(ids[:, 0], minlength=v), want)
    assert ok, (stat, crit)
    assert 1 < int(keep.sum()) < v  # the nucleus cuts
