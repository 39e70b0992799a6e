"""Issue 5 groundwork: self-distilled data from the target, and the reduced draft vocabulary."""

from __future__ import annotations

import torch

from conftest import compose_cfg
from engine.loading import load_model
from engine.train.selfdistill import synthesize
from engine.train.vocab import build_draft_vocab
from pipeline.config import to_run_config


def tiny_target(outputs):
    cfg = to_run_config(compose_cfg("model=tiny", "device=cpu"))
    return load_model(cfg.model, outputs / "weights", torch.device("cpu"), torch.float32)


def test_synthesize_prompts_and_answers_from_the_target(outputs):
    target = tiny_target(outputs)
    samples = synthesize(target, n=5, batch_size=4, max_prompt_tokens=24, max_answer_tokens=12, seed=1,
                         min_prompt_chars=1)
    assert len(samples) == 5
    tok = target.tokenizer
    for s in samples:
        assert s.prompt_ids == tok.encode_chat(s.user)  # the chat template around the synthesised message
        assert 0 < len(s.answer_ids) <= 12 and s.ids[: len(s.prompt_ids)] == s.prompt_ids
    assert len({s.user for s in samples}) > 1  # sampled, not one message repeated
    again = synthesize(target, n=5, batch_size=4, max_prompt_tokens=24, max_answer_tokens=12, seed=1,
                       min_prompt_chars=1)
    assert [s.ids for s in again] == [s.ids for s in samples]  # seeded
    # greedy answers are the target's own continuation of each prompt
    from engine.generate import Generator
    from engine.sampling import SamplingParams

    ref = Generator(target.model, 1).generate([samples[0].prompt_ids], SamplingParams(max_new_tokens=12),
                                              tok.eos_token_ids)[0].tokens
    assert ref == samples[0].answer_ids


def test_draft_vocab_keeps_the_most_frequent_tokens():
    seqs = [[5, 5, 5, 9, 9, 1], [9, 7, 5, 3]]
    d2t, t2d = build_draft_vocab(seqs, vocab_size=12, draft_vocab_size=4, always=[11])
    used = torch.arange(4) + d2t  # draft id -> target id
    assert used.tolist() == [1, 5, 9, 11]  # 5 (x4), 9 (x3), then 1 over 3 and 7 (tie: lower id), and EOS 11
    assert t2d.nonzero().flatten().tolist() == used.tolist()
    d2t, t2d = build_draft_vocab([[2]], vocab_size=6, draft_vocab_size=3)  # rare data: padded with low ids
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 2] and int(t2d.sum()) == 3
