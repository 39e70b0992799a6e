"""The decoder builder (engine/decoder.py): every forward it builds has one attention break per layer,
keeps the names and meta the graphs and profiles read, and computes the plain forward."""

from __future__ import annotations

import pytest
import torch
from helpers.models import pair
from helpers.spec import AUX

from engine.decoder import ATTN, AUX_LIST, DELTA, STREAM, AttnSource, Residual, StepNames, decoder_steps
from engine.drafts.registry import draft_config, load_head, plan_draft
from engine.program import run_steps


def _head(target, algorithm):
    aux = {"aux_layer_ids": AUX} if algorithm in ("eagle3", "dflash") else {}  # the drafts that read aux layers
    cfg = draft_config(algorithm, init="random", num_steps=3, **aux)
    plan = plan_draft(cfg, target.args)
    return load_head(plan, target, 0, torch.device("cpu"), torch.float32)


def _breaks(steps):
    return [s.is_break for s in steps]


def test_every_program_is_a_segment_then_one_break_and_one_segment_per_layer():
    """The target, EAGLE3 / EAGLE, a multi-layer module and DFlash's block: 1 + 2 x layers steps, the
    breaks exactly the attentions, under the names and meta the graph runners and profiles read."""
    _, target = pair()
    target.set_aux_layers([1, 3])
    steps = target.program(target.new_cache(1))
    names = ["embed+pre0", "attn0", "post0+pre1", "attn1", "post1+pre2", "attn2", "post2+head"]
    assert [s.name for s in steps] == names
    assert _breaks(steps) == [False, True] * 3 + [False]
    assert all(s.meta == {"aux_layer_ids": (1, 3)} for s in steps)
    for algorithm in ("eagle3", "eagle"):
        head = _head(target, algorithm)
        steps = head.program(head.new_cache(1))
        assert [s.name for s in steps] == ["draft_pre", "draft_attn", "draft_post"]
        assert _breaks(steps) == [False, True, False]
        assert all(s.meta == head.graph_meta() for s in steps)
    mtp = _head(target, "multi_layer_eagle")
    steps = mtp.module_program(1, mtp.new_cache(1), "last")
    assert [s.name for s in steps] == ["mtp1_pre", "mtp1_attn", "mtp1_post"] and _breaks(steps) == [False, True, False]
    dflash = _head(target, "dflash")
    steps = dflash.block_program(dflash.new_cache(1), 3)
    n = dflash.args.num_layers
    assert len(steps) == 1 + 2 * n and _breaks(steps) == [False, True] * n + [False]
    assert steps[0].name == "dflash_embed+pre0" and steps[-1].name == f"dflash_post{n - 1}"


@pytest.mark.parametrize("capture", [(0, 1, 2), (1,)])
def test_built_stack_computes_the_plain_forward_and_captures_the_streams_entering_layers(capture):
    """decoder_steps over the tiny target's layers, with its own start and finish: the streams it
    captures are transformers' hidden states entering those layers, and its output the final one."""
    hf, target = pair()
    b, t = 2, 9
    tokens = torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(3))
    cache = target.new_cache(b)

    def finish(env):
        env["out"] = target.model.norm(env[STREAM] + env[DELTA])  # [b, t, hidden]

    steps = decoder_steps(
        [Residual(layer, cache) for layer in target.model.layers],
        cache,
        AttnSource(target, cache.dummy_slot),
        StepNames("first", "attn{i}", "post{i}+pre{j}", "last"),
        start=lambda env: target.model.embed_tokens(env["tokens"]),
        finish=finish,
        capture=capture,
    )
    env = {"tokens": tokens, "positions": torch.arange(t).expand(b, t), "valid": None, "kv_len": t}
    with torch.no_grad():
        run_steps(steps, env)
        want = hf(tokens, output_hidden_states=True).hidden_states  # embeddings, each layer's output (last: normed)
    assert len(env[AUX_LIST]) == len(capture)
    for got, i in zip(env[AUX_LIST], capture):
        torch.testing.assert_close(got, want[i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(env["out"], want[-1], rtol=1e-5, atol=1e-5)
    assert env[ATTN].qpos.tolist() == env["positions"].tolist()  # causal: each query up to its own position


def test_block_source_lets_every_query_of_a_row_see_the_whole_block():
    """AttnSource(block=True) (DFlash): each valid query's bound is its row's last slot; padding reads 0."""
    _, target = pair()
    cache = target.new_cache(2)
    positions = torch.tensor([[4, 5, 6, 7], [9, 10, 11, 12]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    a = AttnSource(target, cache.dummy_slot, torch.float32, block=True).build(
        {"positions": positions, "valid": valid}, torch.float32
    )
    assert a.qpos.tolist() == [[7, 7, 7, 7], [10, 10, 0, 0]]
    assert a.rope_pos.tolist() == [[4, 5, 6, 7], [9, 10, 0, 0]]  # RoPE at each token's own position
