"""Our Llama against transformers with the same random weights: logits, greedy generation, batching."""

from __future__ import annotations

import pytest
import torch
from helpers.models import TINY_CONFIG, hf_greedy, pair, random_prompts, tiny_hf_config
from transformers import Qwen2Config, Qwen2ForCausalLM

from engine.model import LlamaModel
from engine.sampling import BONUS, Draws, SamplingParams, draw
from engine.speculative.generate import Generator


def full_forward(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    return model(ids, torch.arange(t).expand(b, t), model.new_cache(b), kv_len=t).logits


@pytest.mark.parametrize(
    "hf_cfg",
    [
        tiny_hf_config(),
        tiny_hf_config(tie_word_embeddings=False, num_key_value_heads=1, rope_theta=500000.0),
        tiny_hf_config(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ],
    ids=["tied-gqa", "untied-mqa", "llama3-rope"],
)
def test_logits_match_transformers(hf_cfg):
    hf, ours = pair(hf_cfg=hf_cfg)
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = full_forward(ours, ids)
    assert ref.abs().max() > 1.0  # the weights are not degenerate
    assert (got - ref).abs().max().item() < 1e-4


def test_qwen2_style_biases_match_transformers():
    cfg = Qwen2Config(
        **{**TINY_CONFIG, "num_hidden_layers": 2, "tie_word_embeddings": False, "max_position_embeddings": 256}
    )
    hf, ours = pair(Qwen2ForCausalLM, cfg)
    assert ours.args.qkv_bias and not ours.args.o_bias
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (full_forward(ours, ids) - hf(ids).logits).abs().max().item() < 1e-4


def test_incremental_decode_equals_full_forward():
    """Prefill a prefix, then feed tokens one by one through the cache: same logits as one pass."""
    _, ours = pair()
    ids = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = full_forward(ours, ids)
        cache = ours.new_cache(1)
        steps = [ours(ids[:, :12], torch.arange(12)[None], cache, kv_len=12).logits]
        for p in range(12, 20):
            steps.append(ours(ids[:, p : p + 1], torch.tensor([[p]]), cache, kv_len=p + 1).logits)
    assert (torch.cat(steps, 1) - ref).abs().max().item() < 1e-4


def test_greedy_equals_transformers_generate():
    hf, ours = pair()
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for prompt in random_prompts(3):
        got = Generator(ours, 1).generate([prompt], params)[0].tokens
        ref = hf_greedy(hf, prompt, 24)
        assert len(set(got)) > 3  # a varied sequence, not one token repeated
        assert got == ref


def test_batched_equals_one_at_a_time():
    _, ours = pair()
    prompts = random_prompts(5, seed=5)  # different lengths
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    single = [Generator(ours, 1).generate([p], params)[0].tokens for p in prompts]
    gen = Generator(ours, 4)  # 5 prompts: a full batch of 4, then a batch of 1 on the same cache
    batched = [r.tokens for r in gen.generate(prompts[:4], params)] + [gen.generate(prompts[4:], params)[0].tokens]
    assert batched == single


def test_stop_tokens_end_each_sequence_separately():
    _, ours = pair()
    prompts = random_prompts(3, seed=6)
    free = Generator(ours, 3).generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    stop = free[0].tokens[4]  # a token that row 0 produces at step 5
    res = Generator(ours, 3).generate(prompts, SamplingParams(max_new_tokens=16), stop_ids=frozenset({stop}))
    for r, f in zip(res, free):
        cut = f.tokens.index(stop) + 1 if stop in f.tokens else len(f.tokens)
        assert r.tokens == f.tokens[:cut]
        assert r.finish_reason == ("stop" if stop in f.tokens else "length")


@pytest.mark.parametrize("sync_every", [3, 64])
def test_decode_on_device_equals_the_round_loop(sync_every):
    # Self-distillation's path (bookkeeping on the device, a host look every sync_every steps): the same
    # tokens, stops and finish reasons as the round loop, greedy with per-row stops and seeded top-p.
    _, ours = pair()
    prompts = random_prompts(4, seed=8)
    free = Generator(ours, 4).generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    stop = frozenset({free[0].tokens[6], free[2].tokens[11]})
    for params, seed in [
        (SamplingParams(max_new_tokens=20), None),
        (SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20), 0),
    ]:

        def run(params=params, seed=seed, **kw):
            g = torch.Generator().manual_seed(seed) if seed is not None else None
            return Generator(ours, 4).generate(prompts, params, stop_ids=stop, generator=g, **kw)

        ref, got = run(), run(sync_every=sync_every)
        assert [r.tokens for r in got] == [r.tokens for r in ref]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in ref]
        if seed is None:
            assert {r.finish_reason for r in ref} == {"stop", "length"}  # greedy rows end both ways
        else:
            assert len({tuple(r.tokens) for r in ref + got}) == 4  # sampled, and the same four again
        assert [len(r.accepts) for r in got] == [len(r.tokens) - 1 for r in got]
        assert all(r.decode_s >= 0 and r.ttft_s >= 0 for r in got)


def test_sampling_is_seeded_and_respects_top_p():
    _, ours = pair()
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, ignore_eos=True)
    prompt = random_prompts(1, seed=7)
    a = Generator(ours, 1).generate(prompt, params, generator=torch.Generator().manual_seed(0))[0].tokens
    b = Generator(ours, 1).generate(prompt, params, generator=torch.Generator().manual_seed(0))[0].tokens
    c = Generator(ours, 1).generate(prompt, params, generator=torch.Generator().manual_seed(1))[0].tokens
    assert a == b and a != c

    logits = torch.tensor([4.0, 3.0, 0.0, -1.0])
    p = torch.softmax(logits, -1)  # .71, .26, ...: the top two reach 0.8
    n = 2000  # a row per seed
    rows = Draws(torch.ones(n), torch.full((n,), 0.8), torch.arange(n))
    draws = draw(logits.expand(n, 1, 4), rows, torch.zeros(n, dtype=torch.long), BONUS, kernels=False)[:, 0]
    freq = torch.bincount(draws, minlength=4).float() / n
    assert freq[2:].sum() == 0 and abs(freq[0] - p[0] / p[:2].sum()) < 0.04
