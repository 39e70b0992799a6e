"""Self-distilled data from the target, and the reduced draft vocabulary."""

from __future__ import annotations

import pytest
import torch
from helpers.models import spread_init, synth, tiny_target

from engine.drafts.eagle3.vocab import build_draft_vocab
from engine.train.selfdistill import Sample, cut_share


def test_synthesize_prompts_and_answers_from_the_target(outputs):
    target = tiny_target(outputs)
    samples = synth(target, n=5, batch_size=4, max_prompt_tokens=24, max_answer_tokens=12, seed=1, min_prompt_chars=1)
    assert len(samples) == 5
    tok = target.tokenizer
    for s in samples:
        assert s.prompt_ids == tok.encode_chat(s.user)  # the chat template around the synthesised message
        assert 0 < len(s.answer_ids) <= 12 and s.ids[: len(s.prompt_ids)] == s.prompt_ids
    assert len({s.user for s in samples}) > 1  # sampled, not one message repeated
    again = synth(target, n=5, batch_size=4, max_prompt_tokens=24, max_answer_tokens=12, seed=1, min_prompt_chars=1)
    assert [s.ids for s in again] == [s.ids for s in samples]  # seeded
    whole = synth(
        target,
        n=5,
        batch_size=4,
        max_prompt_tokens=24,
        max_answer_tokens=12,
        seed=1,
        min_prompt_chars=1,
        prompt_top_p=1.0,
    )  # the whole distribution: other messages
    assert [s.user for s in whole] != [s.user for s in samples]
    # the samples do not depend on how the decoding ran: the round loop (a host look every step) and
    # looks every 5 steps give the same ones (each batch also draws from its own seeded generator, so
    # steps run past a batch's end cannot shift the next batch's draws)
    for sync_every in (1, 5):
        other = synth(
            target,
            n=5,
            batch_size=4,
            max_prompt_tokens=24,
            max_answer_tokens=12,
            seed=1,
            min_prompt_chars=1,
            sync_every=sync_every,
        )
        assert [s.ids for s in other] == [s.ids for s in samples]
    # greedy answers are the target's own continuation of each prompt, whichever batch it came in
    from engine.sampling import SamplingParams
    from engine.speculative.generate import Generator

    for s in samples:
        ref = (
            Generator(target.model, 1)
            .generate([s.prompt_ids], SamplingParams(max_new_tokens=12), tok.eos_token_ids)[0]
            .tokens
        )
        assert ref == s.answer_ids


def test_system_prompts_steer_the_user_messages_row_by_row(outputs):
    """Row i of a batch writes its user message under system_prompts[i % n]; the answer is asked for
    under the template's default, as the eval asks."""
    from engine.sampling import SamplingParams
    from engine.speculative.generate import Generator

    target = tiny_target(outputs)
    spread_init(target.model, seed=2)  # outputs that depend on the context
    tok, systems = target.tokenizer, ["You teach math.", ""]
    steered, plain = tok.user_turn(systems[0]), tok.user_turn()
    assert steered[0] != plain[0] and steered[1] == plain[1]  # a different prefix, the same end of turn
    # greedy messages: what a row writes depends on its prefix alone
    kw = dict(
        n=4, batch_size=4, max_prompt_tokens=24, max_answer_tokens=6, seed=3, min_prompt_chars=0, prompt_temperature=0.0
    )
    samples = synth(target, system_prompts=systems, **kw)
    # the messages are what the target writes after each row's own prefix
    prefixes = [steered[0], plain[0], steered[0], plain[0]]
    users = [
        tok.decode([t for t in r.tokens if t not in plain[1]]).strip()
        for r in Generator(target.model, 4).generate(prefixes, SamplingParams(max_new_tokens=24), plain[1])
    ]
    assert [s.user for s in samples] == users
    assert all(s.prompt_ids == tok.encode_chat(s.user) for s in samples)  # answered under the default
    assert [s.user for s in synth(target, **kw)] != users  # without them: other messages


def test_user_messages_cut_at_max_prompt_tokens_are_flagged_or_drawn_again(outputs):
    """A message that reaches max_prompt_tokens before its turn ends is answered as it is and flagged
    `cut`, or with drop_cut drawn again; the flag survives the samples' cache on disk."""
    from engine.sampling import SamplingParams
    from engine.speculative.generate import Generator
    from engine.train.data import load_samples, save_samples

    target = tiny_target(outputs)
    spread_init(target.model, seed=2)
    tok = target.tokenizer
    systems = ["", "You teach math.", "You write code.", "You are a poet.", "You solve puzzles.", "You are a chemist."]
    prefixes = [tok.user_turn(sp or None)[0] for sp in systems]
    end = tok.user_turn()[1]
    with torch.no_grad():  # an end of turn likely enough that some greedy messages end inside the limit
        w = target.model.lm_head.weight
        w[min(end)] = w.mean(0) * 30
    # greedy messages: what a row writes depends on its prefix alone
    ref = Generator(target.model, len(prefixes)).generate(prefixes, SamplingParams(max_new_tokens=5), end)
    ended = [any(t in end for t in r.tokens) for r in ref]
    assert 0 < sum(ended) < len(ended)  # both kinds in one batch
    kw = dict(
        batch_size=len(systems),
        max_prompt_tokens=5,
        max_answer_tokens=4,
        seed=0,
        min_prompt_chars=0,
        prompt_temperature=0.0,
        system_prompts=systems,
    )
    samples = synth(target, n=len(systems), **kw)
    assert [s.cut for s in samples] == [not e for e in ended]
    assert cut_share(samples) == pytest.approx(1 - sum(ended) / len(ended))
    kept = synth(target, n=sum(ended), drop_cut=True, **kw)
    assert [s.user for s in kept] == [s.user for s, e in zip(samples, ended) if e] and cut_share(kept) == 0
    # under a system message whose greedy message is always cut, no sample: the tries are bounded, and said so
    cut_only = [sp for sp, e in zip(systems, ended) if not e][:1]
    with pytest.warns(UserWarning, match="0 of 8 samples .* or cut at max_prompt_tokens=5"):
        assert synth(target, n=8, drop_cut=True, **{**kw, "system_prompts": cut_only}) == []

    meta = {"data": "key"}
    save_samples(outputs / "cache", samples, meta, 1.0)
    assert load_samples(outputs / "cache", meta) == samples


def test_draft_vocab_keeps_the_most_frequent_tokens():
    seqs = [[5, 5, 5, 9, 9, 1], [9, 7, 5, 3]]
    d2t, t2d = build_draft_vocab(seqs, vocab_size=12, draft_vocab_size=4, always=[11])
    used = torch.arange(4) + d2t  # draft id -> target id
    assert used.tolist() == [1, 5, 9, 11]  # 5 (x4), 9 (x3), then 1 over 3 and 7 (tie: lower id), and EOS 11
    assert t2d.nonzero().flatten().tolist() == used.tolist()
    d2t, t2d = build_draft_vocab([[2]], vocab_size=6, draft_vocab_size=3)  # rare data: padded with low ids
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 2] and int(t2d.sum()) == 3


def test_target_batch_causal_prefill_equals_the_cache_prefix_attention(outputs):
    """The training batch's target pass as one causal SDPA over fresh rows gives the features, labels
    and greedy tokens of the engine's own attention on every trained position, with rows of different
    lengths in one right-padded batch and stale slots left in the cache by an earlier, longer batch."""
    from engine.drafts.base import FeatureKind
    from engine.model import StaticKVCache
    from engine.train.data import VocabMap, target_batch

    target = tiny_target(outputs).model
    target.set_aux_layers([1, 2, 3])
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, target.args.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    long = [Sample("", ids(10), ids(30)) for _ in range(3)]
    samples = [Sample("", ids(6), ids(n)) for n in (4, 17, 9)]
    vocab = VocabMap(torch.zeros(48, dtype=torch.long) + 3, torch.zeros(target.args.vocab_size, dtype=torch.bool))
    for features in (FeatureKind.aux, FeatureKind.final):
        cache = StaticKVCache(target.args, 3, 64, torch.device("cpu"), torch.float32)
        target_batch(target, cache, long, vocab, 64, "cpu", features)  # leaves slots 0..39 written
        ref = target_batch(target, cache, samples, vocab, 64, "cpu", features, causal=False)
        target_batch(target, cache, long, vocab, 64, "cpu", features)
        out = target_batch(target, cache, samples, vocab, 64, "cpu", features, causal=True)
        m = ref.mask
        assert m.any() and torch.equal(out.mask, m) and not m.all()  # padding in the batch
        torch.testing.assert_close(out.feats[m], ref.feats[m])
        torch.testing.assert_close(out.labels[m], ref.labels[m])
        assert torch.equal(out.top[m], ref.top[m]) and torch.equal(out.tokens, ref.tokens)
    # padded wider (a rank's part as wide as the whole batch under torchrun): the same trained positions
    wide = target_batch(target, cache, samples, vocab, 64, "cpu", features, width=40)
    w = out.mask.shape[1]
    assert wide.mask.shape[1] == 39 and not wide.mask[:, w:].any() and torch.equal(wide.mask[:, :w], out.mask)
    torch.testing.assert_close(wide.feats[:, :w][out.mask], out.feats[out.mask])
    # spans: the mask's trained positions [first, end) per row, on the host; also for rows cut at max_len
    # inside the answer or the prompt (no trained position)
    cut = samples + [Sample("", ids(9), ids(4))]
    for max_len in (64, 12, 8):
        batch = target_batch(
            target, StaticKVCache(target.args, 4, 64, torch.device("cpu"), torch.float32), cut, vocab, max_len, "cpu"
        )
        p = torch.arange(batch.mask.shape[1])
        assert batch.spans.device.type == "cpu" and batch.spans.shape == (4, 2)
        spanned = (p >= batch.spans[:, :1]) & (p < batch.spans[:, 1:])
        assert torch.equal(spanned, batch.mask), max_len
    assert not batch.mask[3].any() and batch.mask[1].any()  # max_len 8: the fourth prompt is cut
    # padded to more rows (a rank's part as many rows as the largest part): copies of the last sample that
    # train nothing, the rows before them unchanged
    cache5 = StaticKVCache(target.args, 5, 64, torch.device("cpu"), torch.float32)
    tall = target_batch(target, cache5, samples, vocab, 64, "cpu", features, rows=5)
    n = len(samples)
    assert tall.mask.shape[0] == 5 and not tall.mask[n:].any() and torch.equal(tall.mask[:n], out.mask)
    assert torch.equal(tall.spans[n:, 0], tall.spans[n:, 1]) and torch.equal(tall.spans[:n], out.spans)
    assert torch.equal(tall.tokens[n:], tall.tokens[n - 1 : n].expand(5 - n, -1))
    torch.testing.assert_close(tall.feats[:n][out.mask], out.feats[out.mask])


def check_target_graphs(outputs, device: str, dtype, policy: str, tol: float) -> None:
    """The target's training graphs give the eager pass's features, labels and tokens at every position of
    a live row, for batches narrower than their bucket and with fewer rows; a bucket per width class,
    holding its class's most rows."""
    from engine.drafts.base import FeatureKind
    from engine.model import StaticKVCache
    from engine.train.data import VocabMap, target_batch
    from engine.train.target_graphs import TargetGraphs

    target = tiny_target(outputs, device, dtype).model
    target.set_aux_layers([1, 2, 3])
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, target.args.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    groups = [[Sample("", ids(6), ids(n)) for n in lengths] for lengths in ((4, 17, 9), (12, 3), (30, 29, 20, 25))]
    shapes = [(len(x), max(len(s.ids) for s in x)) for x in groups]  # (3, 23), (2, 18), (4, 36)
    vocab = VocabMap.identity(target.args.vocab_size, device)
    cache = StaticKVCache(target.args, 4, 64, torch.device(device), dtype)
    graphs = TargetGraphs(target, cache, [shapes], policy=policy)
    assert graphs.runner.buckets == [(4, 48), (3, 32)]  # largest first
    for group in groups + [groups[1][:1]]:
        for features in (FeatureKind.aux, FeatureKind.final):
            ref = target_batch(target, cache, group, vocab, 64, device, features)
            out = target_batch(target, cache, group, vocab, 64, device, features, graphs=graphs)
            assert out.feats.shape == ref.feats.shape and out.label_logits.shape == ref.label_logits.shape
            live = torch.arange(ref.mask.shape[1]) < torch.tensor([len(s.ids) - 1 for s in group])[:, None]
            live = live.to(ref.mask.device)
            torch.testing.assert_close(out.feats[live], ref.feats[live], atol=tol, rtol=tol)
            torch.testing.assert_close(out.label_logits[live], ref.label_logits[live], atol=tol, rtol=tol)
            assert torch.equal(out.mask, ref.mask) and torch.equal(out.tokens, ref.tokens)
    assert graphs.stats.replays == 8 and graphs.stats.fallbacks == 0
    with pytest.raises(ValueError, match="5 rows exceeds the cache's 4"):
        TargetGraphs(target, cache, [[(5, 10)]], policy=policy)
    # two sets (a rank's parts, the held-out batches) in one width class: a bucket each, a part in its own
    two = TargetGraphs(target, cache, [[(2, 23)], [(4, 20)]], policy=policy)
    assert two.runner.buckets == [(4, 32), (2, 32)] and two.runner.bucket_for(2, 23) == (2, 32)


def test_target_graphs_replay_the_training_pass_over_padded_buckets(outputs):
    """The debug backend: the runner's static buffers, padding and slicing, replayed eagerly."""
    from engine.train.target_graphs import width_buckets

    assert width_buckets([(5, 20), (7, 17), (3, 32), (9, 33)], 16) == [(7, 32), (9, 48)]
    check_target_graphs(outputs, "cpu", torch.float32, "debug", 1e-5)


@pytest.mark.gpu
def test_target_graphs_on_cuda_match_the_eager_pass(outputs):
    """CUDA graphs (the trainer's policy) in bf16: the same pass up to cuBLAS's choice by shape."""
    check_target_graphs(outputs, "cuda", torch.bfloat16, "full", 2e-2)


def test_label_temperature_sharpens_the_labels_toward_the_greedy_token(outputs):
    """train.label_temperature: the labels are softmax(z / T) over the draft vocabulary, the same
    distribution as the target's own raised to 1 / T and renormalized; the draft's target token (`top`),
    the features and the mask do not move."""
    from engine.drafts.eagle3.vocab import build_draft_vocab
    from engine.model import StaticKVCache
    from engine.train.data import VocabMap, target_batch

    target = tiny_target(outputs).model
    spread_init(target, seed=4)  # peaked and flat positions both
    target.set_aux_layers([1, 2, 3])
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, target.args.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    samples = [Sample("", ids(5), ids(n)) for n in (7, 12)]
    vocab = VocabMap(*build_draft_vocab([s.ids for s in samples], target.args.vocab_size, 64))
    cache = StaticKVCache(target.args, 2, 32, torch.device("cpu"), torch.float32)
    own = target_batch(target, cache, samples, vocab, 32, "cpu")
    sharp = target_batch(target, cache, samples, vocab, 32, "cpu", label_temperature=0.5)
    m = own.mask
    torch.testing.assert_close(sharp.labels[m], (own.labels[m].log() / 0.5).softmax(-1))
    assert torch.equal(sharp.top, own.top) and torch.equal(sharp.feats, own.feats) and torch.equal(sharp.mask, m)
    entropy = lambda p: -(p * p.clamp_min(1e-30).log()).sum(-1)  # noqa: E731
    assert bool((entropy(sharp.labels[m]) < entropy(own.labels[m])).all())
    greedy = own.label_logits.argmax(-1, keepdim=True)  # the target's most likely draft token gains probability
    gain = sharp.labels.gather(-1, greedy) - own.labels.gather(-1, greedy)
    assert bool((gain[m] > 0).all())


def test_target_batch_top_is_the_targets_greedy_token_on_its_own_answers(outputs):
    """`top` is the sample's next token: on the target's own (greedy) answers, the argmax of its logits
    over the whole vocabulary at every trained position; `label_logits` are those logits' draft-vocabulary
    columns (the target's pass computes only those rows of its lm_head)."""
    from engine.model import StaticKVCache
    from engine.train.data import VocabMap, target_batch

    loaded = tiny_target(outputs)
    target = loaded.model
    spread_init(target, seed=4)  # peaked answers, no near-ties
    target.set_aux_layers([1, 2, 3])
    samples = synth(loaded, n=6, batch_size=6, max_prompt_tokens=12, max_answer_tokens=16, seed=2, min_prompt_chars=1)
    vocab = VocabMap(*build_draft_vocab([s.ids for s in samples[:3]], target.args.vocab_size, 48))
    cache = StaticKVCache(target.args, 6, 64, torch.device("cpu"), torch.float32)
    batch = target_batch(target, cache, samples, vocab, 64, "cpu")
    lens = [len(s.ids) for s in samples]
    ids = torch.zeros(6, max(lens), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : lens[i]] = torch.tensor(s.ids)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    z = target(
        ids, positions, cache.rows(6), valid=positions < torch.tensor(lens)[:, None], kv_len=ids.shape[1], causal=True
    ).logits[:, 1:]  # [B, L-1, V]: the whole vocabulary
    m = batch.mask
    assert m.sum() > 40
    assert torch.equal(batch.top[m], vocab.to_draft[z.argmax(-1)][m])  # the greedy token, as a draft id
    assert (batch.top[m] == -1).any() and (batch.top[m] >= 0).any()  # some answer tokens outside the vocab
    torch.testing.assert_close(batch.label_logits, z[..., vocab.used])
