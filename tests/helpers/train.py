"""Test-sized draft training runs on the tiny target, and the checks several drafts' tests share."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.runs import compose_cfg


def assert_trained_beats_random(
    outputs: Path, tmp_path: Path, common: list[str], trained: list[str], random_: list[str]
) -> None:
    """On the prompts the training synthesized (a question.jsonl written from the shared samples), a
    trained head drafts clearly better than a random one through the real loop, and both keep greedy
    output the target's. `common`: overrides for both evals, then each one's own."""
    import json

    from pipeline.__main__ import run

    (data,) = (outputs / "train" / "data").glob("*/samples.jsonl")
    qfile = tmp_path / "question.jsonl"
    qfile.write_text(
        "".join(
            json.dumps({"question_id": i, "turns": [json.loads(line)["user"]]}) + "\n"
            for i, line in enumerate(open(data))
        )
    )
    both = [*common, f"eval.dataset={qfile}", "tracking=off"]
    good, bad = (run(compose_cfg(*both, *own))["eval_results"]["metrics"] for own in (trained, random_))
    assert good["match_baseline"] == 1.0 and bad["match_baseline"] == 1.0
    assert good["accept_length"] > bad["accept_length"] + 0.2, (good["accept_length"], bad["accept_length"])


def assert_triton_ops_match_torch_ops(forward, head, batch, steps: int, trained: set[str]) -> None:
    """A training forward with the Triton norms and RoPE (train.kernels=triton) gives the torch ops'
    logits and, through the loss's backward, their gradients (fp32); the `trained` parameters get one."""
    from engine.drafts.common.ttt import TORCH_OPS, TRITON_OPS
    from engine.drafts.train_contract import ttt_loss

    head.requires_grad_(True)
    out = {}
    for ops in (TORCH_OPS, TRITON_OPS):
        logits = forward(head, batch, steps, ops=ops)
        head.zero_grad()
        ttt_loss(logits, batch)[0].backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        out[ops] = ([lg.detach() for lg in logits], grads)
    (l0, g0), (l1, g1) = out[TORCH_OPS], out[TRITON_OPS]
    for a, b in zip(l0, l1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert g0.keys() == g1.keys() and trained <= g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-3, msg=n)


# A draft training run on the tiny target in seconds (16 self-distilled samples, short sequences); each
# test adds its recipe (+experiment=train_<draft>_smollm2) and its steps, TTT steps and cadence.
TINY_TRAIN = [
    "model=tiny",
    "model.random.init_std=0.15",
    "train.data.num_samples=16",
    "train.data.batch_size=8",
    "train.data.max_prompt_tokens=12",
    "train.data.max_answer_tokens=24",
    "train.data.min_prompt_chars=1",
    "train.heldout=0.25",
    "train.warmup_steps=5",
    "train.max_tokens=1024",
    "train.max_len=64",
]


def tiny_train(recipe: str, k: int = 3, steps: int = 40) -> list[str]:
    """TINY_TRAIN for `+experiment=<recipe>` with k drafts (TTT steps and eval k alike), a short run
    that evaluates and saves every 20 steps, and the real loop's eval on 4 prompts."""
    return [
        f"+experiment={recipe}",
        *TINY_TRAIN,
        f"draft.num_steps={k}",
        "train.lr=5e-3",
        "train.eval_every=20",
        "train.save_every=20",
        f"train.ttt_steps={k}",
        f"train.eval_k={k}",
        f"train.steps={steps}",
        "train.loop_eval_prompts=4",
    ]


# The EAGLE3 recipe on the tiny target, fp32 on every device: in bf16 (the CUDA default) near-ties of a
# random head's argmax flip between the batched teacher-forced forward and the engine's decode kernels, and
# the replayed loop stops equalling the real one (1.227 vs 1.211 on an H200)
EAGLE3_TRAIN = [
    "dtype=float32",
    *TINY_TRAIN,
    "+experiment=train_eagle3_smollm2",
    "draft.aux_layer_ids=[1,2,3]",
    "draft.draft_vocab_size=96",
    "train.lr=5e-3",
    "train.eval_every=20",
    "train.save_every=20",
    "train.ttt_steps=4",
    "train.eval_k=3",
]


# The DFLASH recipe on the tiny target: a 4-token block, 3 drafts, 4 key/value heads (one per query head,
# as the recipe's 9 are for SmolLM2's 9)
DFLASH_TRAIN = [
    "+experiment=train_dflash_smollm2",
    *TINY_TRAIN,
    "draft.init=random",
    "draft.aux_layer_ids=[1,2,3]",
    "draft.aux_layer_convention=input_of",
    "draft.block_size=4",
    "draft.num_steps=3",
    "draft.num_kv_heads=4",
    "train.lr=1e-2",
    "train.eval_every=30",
    "train.save_every=30",
    "train.ttt_steps=3",
    "train.eval_k=3",
    "train.loop_eval_prompts=2",
    "train.loop_eval_tokens=16",
]
