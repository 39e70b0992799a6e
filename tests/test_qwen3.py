"""A Qwen3 target (per-head q/k RMSNorm before RoPE, head_dim from config, tied embeddings) against
transformers' Qwen3ForCausalLM with the same random weights (fp32, CPU): logits, aux hidden states in both
conventions, greedy generation; the fused path (Triton interpreter) against the plain one."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.models import qwen3_pair, random_prompts

from engine.aux_layers import normalise
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator

FUSED = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _forward(model, ids: torch.Tensor):
    b, t = ids.shape
    return model(ids, torch.arange(t).expand(b, t), model.new_cache(b), kv_len=t)


def test_logits_match_transformers_and_the_qk_norms_matter():
    hf, ours = qwen3_pair()
    assert ours.args.qk_norm and ours.args.head_dim == 32 and not ours.args.qkv_bias
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = _forward(ours, ids).logits
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
        for layer in ours.model.layers:  # unit q/k norm weights: the logits move (the norms are applied)
            layer.self_attn.q_norm.weight.fill_(1.0)
        assert (_forward(ours, ids).logits - ref).abs().max() > 1e-2


@pytest.mark.parametrize("convention, ids", [("input_of", [0, 2, 3]), ("output_of", [0, 1, 2])])
def test_aux_hidden_states_match_transformers_in_both_conventions(convention, ids):
    """input_of i: the stream entering layer i (3: the last layer's output, whose final norm is transformers'
    last hidden state); output_of i: layer i's output, transformers' hidden_states[i + 1]."""
    hf, ours = qwen3_pair()
    n = ours.args.num_layers
    ours.set_aux_layers(normalise(ids, convention, n))
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = _forward(ours, tokens)
        want = hf(tokens, output_hidden_states=True).hidden_states  # embeddings, each layer's output (last normed)
    for got, i in zip(out.aux_hidden_states.chunk(len(ids), dim=-1), ids):
        j = i if convention == "input_of" else i + 1  # index into transformers' hidden_states
        if j < n:
            torch.testing.assert_close(got, want[j], rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(ours.model.norm(got), want[j], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden_states, want[-1], rtol=1e-5, atol=1e-5)


def test_greedy_equals_transformers_generate():
    hf, ours = qwen3_pair()
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    for prompt in random_prompts(2):
        got = Generator(ours, 1).generate([prompt], params)[0].tokens
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert len(set(got)) > 3  # a varied sequence, not one token repeated
        assert got == ref


@pytest.mark.skipif(not FUSED, reason="needs CUDA or TRITON_INTERPRET=1")
def test_fused_path_equals_plain_and_a_decode_row_is_batch_invariant():
    """The fused path (q/k norms inside the RoPE + cache-write kernel, the rows kernels, the Triton
    attention): the plain path's logits and aux states; a decode row's logits bitwise the same alone and
    beside other rows."""
    _, target = qwen3_pair(max_seq_len=64)
    target.set_aux_layers([1, 3])
    ids = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = _forward(target, ids)
        target.attention_kernel = True
        target.use_fused_kernels()
        got = _forward(target, ids)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got.aux_hidden_states, ref.aux_hidden_states, rtol=1e-5, atol=1e-4)

        def decode(rows: slice) -> torch.Tensor:  # a 6-token prefill, then one decode step of these rows
            b = rows.stop - rows.start
            cache = target.new_cache(b)
            target(ids[rows, :6], torch.arange(6).expand(b, 6), cache, kv_len=6)
            return target(ids[rows, 6:], torch.full((b, 1), 6), cache, kv_len=7).logits  # [b, 1, vocab]

        assert torch.equal(decode(slice(0, 3))[1], decode(slice(1, 2))[0])
