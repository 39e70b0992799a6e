"""The draft heads shipped for SmolLM2-135M-Instruct (engine/drafts/checkpoints): each is its draft's
default, loads, drafts the real target losslessly under `none` and `debug` graphs and far better than a
random head, is described by a card whose command reproduces its training config, and round-trips
through the public bf16 layout its anchors load."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from helpers.runs import compose_cfg
from safetensors import safe_open

from engine.drafts import storage
from engine.drafts.checkpoint import HeadCheckpoint
from pipeline.__main__ import run
from pipeline.config import to_run_config

CHECKPOINTS = Path(__file__).resolve().parents[1] / "engine" / "drafts" / "checkpoints"
# name -> (experiment, draft config, architecture, tensor names of the public layout that must be there)
HEADS = {
    "eagle3": ("eagle3", "eagle3", "LlamaForCausalLMEagle3", ["fc.weight", "midlayer.self_attn.q_proj.weight", "d2t"]),
    "eagle": (
        "eagle",
        "eagle",
        "LlamaForCausalLMEagle",
        ["fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"],
    ),
    "mtp": (
        "mtp",
        "multi_layer_eagle",
        "LlamaForCausalLMMultiLayerEagle",
        [
            "layers.3.eh_proj.weight",
            "layers.0.enorm.weight",
            "layers.0.hnorm.weight",
            "layers.0.shared_head.norm.weight",
            "layers.3.mlp.gate_proj.weight",
        ],
    ),
    "dflash": (
        "dflash",
        "dflash",
        "DFlashDraftModel",
        ["fc.weight", "hidden_norm.weight", "norm.weight", "layers.2.self_attn.k_proj.weight"],
    ),
}
# train.* keys that only change what a run reports or where it writes, not the weights it trains
REPORTING = {
    "eval_every",
    "save_every",
    "eval_k",
    "loop_eval_prompts",
    "loop_eval_tokens",
    "resume",
    "export_dir",
    "name",
}


def card_command(card: str) -> list[str]:
    (cmd,) = re.findall(r"\(`python -m pipeline ([^`]+)`\)", card)
    return shlex.split(cmd)


@pytest.mark.parametrize("name", HEADS)
def test_the_card_command_reproduces_the_training_config(name):
    """The card's command composes to the train.* and train.data.* the head was trained with (every key
    that shapes the weights), with the draft algorithm and shape of the shipped config.json."""
    head = CHECKPOINTS / f"smollm2-135m-instruct-{name}"
    facts = json.loads((head / "training.json").read_text())
    card = (head / "README.md").read_text()
    assert "self-distilled" in card and "accept_length" in card
    cfg = to_run_config(compose_cfg(*card_command(card), "device=cpu"))
    plain = lambda d: json.loads(json.dumps(d))  # noqa: E731  tuples -> lists, as training.json holds them
    train = dataclasses.asdict(cfg.train)
    data = {k: v for k, v in train.pop("data").items() if k not in ("graph", "sync_every")}
    got = {k: v for k, v in train.items() if k not in REPORTING}
    assert plain(got) == {k: facts["train"][k] for k in got}
    assert plain(data) == {k: facts["data"][k] for k in data}
    assert cfg.draft.algorithm == facts["algorithm"] == HEADS[name][1]
    shipped = json.loads((head / "config.json").read_text())
    assert shipped["architectures"] == [HEADS[name][2]]
    shape = ("num_layers", "block_size", "intermediate_size", "num_kv_heads", "sliding_window")
    for key in shape:  # the recipe's shape is the head's
        want = getattr(cfg.draft, key, None)
        have = {
            "num_layers": shipped.get("num_hidden_layers"),
            "block_size": shipped.get("block_size"),
            "intermediate_size": shipped.get("intermediate_size"),
            "num_kv_heads": shipped.get("num_key_value_heads"),
            "sliding_window": shipped.get("sliding_window"),
        }[key]
        assert want is None or want == have, (key, want, have)


@pytest.mark.parametrize("name", HEADS)
def test_a_shipped_head_round_trips_through_the_public_bf16_layout(name, tmp_path):
    """`python -m engine.drafts.storage DIR OUT --dtype bf16` writes the public layout (no scales, the
    anchors' tensor names, bf16 matrices); it reads back to the fp8 head's own values (bf16 rounding), and
    writing fp8 from it again gives the shipped file's tensors."""
    head = CHECKPOINTS / f"smollm2-135m-instruct-{name}"
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    storage.write_checkpoint(head, bf16, "bf16")
    with safe_open(str(bf16 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in names if k.endswith("proj.weight") or k == "fc.weight"}
    assert not any(k.endswith(storage.SCALE_SUFFIX) for k in names)
    assert set(HEADS[name][3]) <= names and dtypes == {torch.bfloat16}
    assert (bf16 / "README.md").is_file() and json.loads((bf16 / "config.json").read_text()) == json.loads(
        (head / "config.json").read_text()
    )
    shipped, public = storage.read_state(head / "model.safetensors"), storage.read_state(bf16 / "model.safetensors")
    assert shipped.keys() == public.keys()
    for k in shipped:
        torch.testing.assert_close(public[k].float(), shipped[k].float(), rtol=2**-7, atol=0)
    storage.write_checkpoint(bf16, fp8, "fp8")
    again = storage.read_state(fp8 / "model.safetensors")
    for k in shipped:
        torch.testing.assert_close(again[k].float(), shipped[k].float(), rtol=2**-3, atol=1e-6)
    HeadCheckpoint.read(str(bf16), HEADS[name][2])  # the loader takes the public form as it is


@pytest.fixture(scope="module")
def target_greedy() -> dict:
    """SmolLM2's greedy output on the heads' prompts: generated by the first head's eval, reused by the rest."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("name", HEADS)
def test_a_shipped_head_is_its_default_and_drafts_smollm2_losslessly(name, outputs, target_greedy):
    """`+experiment=<draft>` out of the box: the shipped head loads for the default target; under `none`
    and `debug` graphs greedy output is the target's and the head is accepted far more often than a
    random head of the same shape."""
    common = (  # no untimed warm-up generation: nothing here is timed
        f"+experiment={HEADS[name][0]}",
        "device=cpu",
        "eval.limit=2",
        "eval.max_new_tokens=16",
        "eval.warmup=false",
        "tracking=off",
    )
    accepted = {}
    for policy in ("none", "debug"):  # the target's greedy output: generated once, by the first run
        first = "tokens" not in target_greedy
        ctx = run(compose_cfg(*common, f"graph={policy}", f"eval.baseline={str(first).lower()}"))
        assert ctx["draft_head"].__class__.architecture == HEADS[name][2]
        res = ctx["eval_results"]
        if first:
            assert res["metrics"]["match_baseline"] == 1.0
            target_greedy["tokens"] = [r.result.tokens for r in res["baseline"]]
        assert [r.result.tokens for r in res["records"]] == target_greedy["tokens"], policy
        accepted[policy] = res["metrics"]["accept_length"]
    shape = {
        "dflash": [
            "draft.block_size=8",
            "draft.num_layers=3",
            "draft.num_kv_heads=9",
            "draft.aux_layer_ids=[1,8,14,20,27]",
        ],
        "mtp": ["draft.intermediate_size=768"],
    }.get(name, [])
    # a random head is accepted about never: its floor on the first prompt alone (its rounds are the costliest)
    random_ = run(compose_cfg(*common, "eval.limit=1", "eval.baseline=false", "draft.init=random", *shape))
    floor = random_["eval_results"]["metrics"]["accept_length"]
    assert min(accepted.values()) > floor + 0.4, (accepted, floor)
