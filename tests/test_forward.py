"""The plain forwards (engine/model.py, the heads): what they compute, and where a breakable graph splits
them (engine/graphs/breakable.py: each attention is an eager call, everything else is captured)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import pair
from helpers.spec import AUX

from engine.drafts.registry import draft_config, load_head, plan_draft
from engine.graphs.breakable import Capture
from engine.model import Attention

CPU = torch.device("cpu")


def _head(target, algorithm):
    aux = {"aux_layer_ids": AUX} if algorithm in ("eagle3", "dflash") else {}
    cfg = draft_config(algorithm, init="random", num_steps=3, **aux)
    return load_head(plan_draft(cfg, target.args), target, 0, CPU, torch.float32)


def _split(fn, split: bool = True) -> list[tuple[str, object]]:
    """How a breakable capture splits fn(): ("graph", None) and ("call", the attention module) parts."""
    with torch.no_grad():
        parts = Capture(None, CPU, split=split, dry=True).run(fn).parts
    return [(kind, part[1][0] if kind == "call" else None) for kind, _, part in parts]


def _at_attentions(modules) -> list[tuple[str, object]]:
    return [("graph", None), *[p for m in modules for p in (("call", m), ("graph", None))]]


@pytest.mark.parametrize("capture", [(0, 1, 2), (1,), (3,)])
def test_target_forward_returns_the_streams_entering_its_aux_layers(capture):
    """The aux hidden states are transformers' hidden states entering those layers (id 3 = the last
    layer's output, before the final norm), and the hidden states its normed output."""
    hf, target = pair()
    target.set_aux_layers(capture)
    b, t = 2, 9
    tokens = torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = target(tokens, torch.arange(t).expand(b, t), target.new_cache(b), kv_len=t)
        want = hf(tokens, output_hidden_states=True).hidden_states  # embeddings, each layer's output (last: normed)
    got = out.aux_hidden_states.chunk(len(capture), dim=-1)
    for g, i in zip(got, capture):
        if i < target.args.num_layers:
            torch.testing.assert_close(g, want[i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden_states, want[-1], rtol=1e-5, atol=1e-5)
    if 3 in capture:  # the last layer's output: the final norm of it is the hidden state
        torch.testing.assert_close(target.model.norm(got[-1]), want[-1], rtol=1e-5, atol=1e-5)


def test_every_forward_splits_at_its_attentions_only():
    """Under a breakable capture the target, EAGLE3 / EAGLE, a multi-layer module and DFlash's block
    each run one eager call per layer, the attention of that layer, between captured graphs; with
    split off (policy full) each is one graph."""
    _, target = pair()
    b, t = 2, 4
    tokens = torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(t).expand(b, t)

    def target_forward():
        target(tokens, positions, target.new_cache(b), kv_len=t)

    assert _split(target_forward) == _at_attentions([layer.self_attn for layer in target.model.layers])
    assert _split(target_forward, split=False) == [("graph", None)]
    hidden = torch.randn(b, t, target.args.hidden_size)
    for algorithm in ("eagle3", "eagle"):
        head = _head(target, algorithm)
        feats = torch.randn(b, t, head.feature_width)
        a = head.attn_inputs(positions, None, t)
        step = lambda head=head, feats=feats, a=a: head(feats, head.new_cache(b), a, tokens=tokens)  # noqa: E731
        assert _split(step) == _at_attentions([head.attention])
    mtp = _head(target, "multi_layer_eagle")
    a = mtp.attn_inputs(positions, None, t)
    split = _split(lambda: mtp.module_forward(1, tokens, hidden, mtp.new_cache(b)[1], a))
    assert split == _at_attentions([mtp.layers[1].self_attn])
    dflash = _head(target, "dflash")
    a = dflash.block_inputs(positions, None, t, torch.float32)
    split = _split(lambda: dflash(tokens, dflash.new_cache(b), a, 3, False))
    assert split == _at_attentions([layer.self_attn for layer in dflash.layers])
    assert Attention.forward.__wrapped__ is not None  # the mark, on the one call that reads the live kv_len


def test_block_inputs_let_every_query_of_a_row_see_the_whole_block():
    """DFlash's block: each valid query's bound is its row's last slot; padding reads 0; RoPE at each
    token's own position; the mask covers the block past kv_len."""
    _, target = pair()
    dflash = _head(target, "dflash")
    positions = torch.tensor([[4, 5, 6, 7], [9, 10, 11, 12]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    a = dflash.block_inputs(positions, valid, 9, torch.float32)
    assert a.qpos.tolist() == [[7, 7, 7, 7], [10, 10, 0, 0]]
    assert a.rope_pos.tolist() == [[4, 5, 6, 7], [9, 10, 0, 0]]
    assert a.mask().shape[-1] == 9 + dflash.block_size


def test_a_replay_rebuilds_the_mask_even_at_an_unchanged_kv_len():
    """A breakable replay re-runs each attention over positions a graph rewrote in place: the mask follows
    them, also when the runner sets the same kv_len as the replay before (a batch whose longest row
    stopped while the others moved on); within one call every layer shares it."""
    from engine.ops import AttnInputs, Live
    from kernels.decode_attention import slot_mask

    live = Live(6)
    a = AttnInputs.build(torch.tensor([[3, 4]]), None, torch.zeros(16, 8), torch.zeros(16, 8), 16, torch.float32)
    a.kv_len = live
    first = a.mask()
    assert a.mask() is first  # the next layer of the same call
    a.qpos.copy_(torch.tensor([[1, 2]]))  # the next replay's positions
    live.value = 6
    assert torch.equal(a.mask(), slot_mask(a.qpos, None, 6)) and not torch.equal(a.mask(), first)
    assert (live + 1).version == live.version  # a view reads its root's
