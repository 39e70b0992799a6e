"""EAGLE (-1/-2) training (engine/drafts/eagle/train.py): the unrolled forward equals the head's own inference
program where the chain is right, and the train_draft stage trains a head that drafts better than a
random one through the real draft-and-verify loop."""

from __future__ import annotations

import json

import torch
from helpers.models import pair
from helpers.runs import compose_cfg
from helpers.train import assert_trained_beats_random, tiny_train

from engine.drafts.eagle.train import eagle_forward
from engine.drafts.registry import draft_config, load_head, plan_draft
from engine.drafts.train_contract import Batch
from pipeline.__main__ import run


def test_first_step_equals_the_heads_inference_program():
    """Step 0 of the unrolled forward (features f_p, tokens x_{p+1}) is the head's prefill program over
    the same pairs: the logits agree position by position."""
    _, target = pair()
    head = load_head(
        plan_draft(draft_config("eagle", init="random"), target.args),
        target,
        0,
        torch.device("cpu"),
        torch.float32,
    )
    g = torch.Generator().manual_seed(0)
    b, t, h = 2, 9, target.args.hidden_size
    tokens = torch.randint(0, target.args.vocab_size, (b, t), generator=g)
    feats = torch.randn(b, t, h, generator=g)
    positions = torch.arange(t).expand(b, t)
    batch = Batch(
        tokens=tokens,
        positions=positions,
        feats=feats,
        label_logits=torch.zeros(b, t, 1),
        top=tokens,
        mask=torch.ones(b, t, dtype=torch.bool),
    )
    logits = eagle_forward(head, batch, 2)
    a = head.attn_inputs(positions, torch.ones(b, t, dtype=torch.bool), t)
    out = head(feats, head.new_cache(b), a, tokens=tokens)
    assert len(logits) == 2 and logits[0].shape == (b, t, target.args.vocab_size)
    assert torch.allclose(logits[0], out.logits, atol=1e-4)


TRAIN = [*tiny_train("train_eagle_smollm2"), "train.ema_decay=0"]


def test_train_draft_stage_trains_an_eagle_head_that_beats_a_random_one(outputs, tmp_path):
    shipped = tmp_path / "exports" / "shipped"  # an earlier head there is replaced whole
    shipped.mkdir(parents=True)
    (shipped / "config.json").write_text("{}")
    (shipped / "stale.bin").write_bytes(b"0")
    ctx = run(compose_cfg(*TRAIN, f"train.export_dir={shipped}"))
    head_dir = outputs / "train" / "train_eagle_smollm2" / "head"
    assert ctx["draft_checkpoint"] == str(head_dir)
    assert sorted(p.name for p in shipped.iterdir()) == sorted(p.name for p in head_dir.iterdir())
    assert (shipped / "model.safetensors").read_bytes() == (head_dir / "model.safetensors").read_bytes()
    assert [p.name for p in shipped.parent.iterdir()] == ["shipped"]  # nothing staged left beside it
    assert json.loads((head_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    assert "eagle" in (head_dir / "README.md").read_text()
    common = [
        "+experiment=eagle",
        "model=tiny",
        "model.random.init_std=0.15",
        "eval.max_new_tokens=24",
        "eval.batch_size=4",
        "draft.num_steps=3",
    ]
    assert_trained_beats_random(
        outputs, tmp_path, common, ["draft.init=checkpoint", f"draft.path={head_dir}"], ["draft.init=random"]
    )
