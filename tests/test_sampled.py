"""Sampled rounds (engine/speculative/round.py's sampled program): the draft samples its proposals from its own q and
the verify accepts by rejection sampling against it, on the device, with counter-based random numbers.
Lossless in distribution (chi-square against the target's p, EAGLE3 and DFLASH), seeded rows reproduce in
any batch, an opted-out row is plain decoding, the debug runner equals eager (GPU: full and bcg too)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.spec import AUX
from helpers.stats import chi_square_ok

from engine.drafts.registry import draft_config, load_head, make_draft, plan_draft
from engine.model import LlamaModel, ModelArgs, init_normal_
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator, SpecDecoder
from engine.speculative.graph_set import GraphSet, round_name

T, TOP_P = 0.7, 0.9
SAMPLED = SamplingParams(temperature=T, top_p=TOP_P, max_new_tokens=3, ignore_eos=True)


def tiny_target(vocab: int = 24, max_seq_len: int = 32) -> LlamaModel:
    args = ModelArgs(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return init_normal_(LlamaModel(args, max_seq_len), seed=3, std=0.2)


def draft_for(target: LlamaModel, algorithm: str, batch: int, k: int, graphs=None, factor=None):
    """A random draft head (its q unlike p), the EAGLE3 one over a draft vocabulary of 16 of the target's
    24 tokens (a shuffled d2t): its q is mapped to target ids. factor: draft.temperature_factor."""
    kw = {"draft_vocab_size": 16} if algorithm == "eagle3" else {}
    cfg = draft_config(algorithm, init="random", num_steps=k, aux_layer_ids=AUX, temperature_factor=factor, **kw)
    plan = plan_draft(cfg, target.args)
    target.set_aux_layers(plan.aux.input_of)
    head = load_head(plan, target, 0, torch.device("cpu"), torch.float32)
    init_normal_(head, seed=9, std=0.2)
    if algorithm == "eagle3":
        used = torch.randperm(target.args.vocab_size, generator=torch.Generator().manual_seed(5))[:16].sort()[0]
        head.d2t.copy_(used - torch.arange(16))
    return make_draft(plan, head, target, batch, k, cfg=cfg, graphs=graphs), plan, head, cfg


def target_p(target: LlamaModel, ids: list[int]) -> torch.Tensor:
    """The target's distribution after `ids` at temperature T, top-p TOP_P (sorted nucleus, renormalised)."""
    x = torch.tensor([ids])
    z = target(x, torch.arange(len(ids))[None], target.new_cache(1), kv_len=len(ids)).logits[0, -1]
    p = torch.softmax(z.double() / T, -1)
    ranked, order = p.sort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[(ranked.cumsum(0) - ranked) < TOP_P]] = True
    return torch.where(keep, p, 0) / p[keep].sum()


@pytest.mark.parametrize("algorithm, factor", [("eagle3", None), ("dflash", None), ("eagle3", 1.6)])
def test_sampled_rounds_emit_the_targets_distribution(algorithm, factor):
    """6000 seeds of one prompt, k = 2: given the prefill's token x_L = v0, a round's first token is
    distributed as p(. | v0); given x_{L+1} = v1 the next one as p(. | v0, v1), both where it came in the
    same round (d_1 accepted) and where it came in the next one after a rejection (reusing the positions
    the first round drew at): hundreds of rows each; also with the draft's q drawn hotter than the request
    (draft.temperature_factor). The accepted drafts alone fail the test (its power)."""
    torch.manual_seed(0)
    target, n, prompt = tiny_target(), 6000, [1, 2, 3]
    draft, *_ = draft_for(target, algorithm, n, 2, factor=factor)
    res = Generator(target, n, draft, 2).generate([prompt] * n, SAMPLED, seeds=list(range(n)))
    toks = torch.tensor([r.tokens for r in res])  # [n, 3]: x_L, x_{L+1}, x_{L+2}
    first_a = torch.tensor([r.accepts[0] for r in res])  # round 1's accepted drafts
    v0 = int(toks[:, 0].mode().values)
    at0, kept = toks[:, 0] == v0, first_a > 0
    # v1: the x_{L+1} after v0 with the most rows on both paths (each path's x_{L+2} is p's on its own)
    v1 = max(range(24), key=lambda v: min(int((at0 & (toks[:, 1] == v) & m).sum()) for m in (kept, ~kept)))
    at1 = at0 & (toks[:, 1] == v1)
    cases = ((at0, [v0], 1), (at1 & kept, [v0, v1], 2), (at1 & ~kept, [v0, v1], 2))
    for rows, ctx, pos in cases:
        ok, stat, crit = chi_square_ok(torch.bincount(toks[rows, pos], minlength=24), target_p(target, prompt + ctx))
        assert ok, (algorithm, factor, pos, int(rows.sum()), stat, crit)
    assert int((at0 & kept).sum()) > 500 and int((at0 & ~kept).sum()) > 500  # d_1 accepted / rejected
    assert int((at1 & kept).sum()) > 300 and int((at1 & ~kept).sum()) > 300
    # power: the accepted drafts alone (min(p, q), not p) fail the same test
    accepted = torch.bincount(toks[at0 & kept, 1], minlength=24)
    assert not chi_square_ok(accepted, target_p(target, prompt + [v0]))[0]


def test_a_seeded_row_draws_the_same_tokens_alone_and_beside_others():
    """EAGLE3, k = 3, T = 0.8: a prompt with seed 77 gives the same tokens and acceptances alone (batch 1)
    as in row 1 of 3 beside other prompts and seeds."""
    target = tiny_target(max_seq_len=48)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [1, 2, 3], [9, 4, 4, 4, 2]]
    alone = Generator(target, 1, draft_for(target, "eagle3", 1, 3)[0], 3).generate(prompts[1:2], params, seeds=[77])
    batch = Generator(target, 3, draft_for(target, "eagle3", 3, 3)[0], 3).generate(prompts, params, seeds=[1, 77, 2])
    assert batch[1].tokens == alone[0].tokens and batch[1].accepts == alone[0].accepts
    assert sum(alone[0].accepts) > 0  # drafts were accepted: the rejection-sampling path ran
    other = Generator(target, 1, draft_for(target, "eagle3", 1, 3)[0], 3).generate(prompts[1:2], params, seeds=[78])
    assert other[0].tokens != alone[0].tokens


def test_an_opted_out_request_is_plain_decoding():
    """Through the scheduler, beside a speculating request: requests with speculative=False (sampled with a
    seed, and greedy) accept nothing and emit exactly what plain decoding (k = 0, the same seed) emits."""
    from engine.serve.scheduler import GenerationRequest, Scheduler

    target = tiny_target(max_seq_len=48)
    draft, *_ = draft_for(target, "eagle3", 3, 3)
    sched = Scheduler(SpecDecoder(target, 3, draft, 3), 3, 8)
    done = threading.Semaphore(0)

    def request(prompt, temperature, seed, speculative):
        sink = lambda ev: ev.finish_reason and done.release()  # noqa: E731
        return GenerationRequest(prompt, 12, sink, temperature, 0.9, seed, speculative=speculative)

    reqs = [request([5, 6, 7], 0.8, 5, False), request([1, 2, 3], 0.8, 6, True), request([9, 4, 2], 0.0, None, False)]
    for r in reqs:
        sched.submit(r)
    sched.start()
    for _ in reqs:
        assert done.acquire(timeout=120)
    sched.close()
    for r in (reqs[0], reqs[2]):
        params = SamplingParams(r.temperature, 0.9, max_new_tokens=12, ignore_eos=True)
        plain = Generator(target, 1).generate([r.prompt], params, seeds=[r.seed or 0])[0].tokens
        assert r.output == plain and not any(r.accepts)
    assert any(reqs[1].accepts)  # the speculating request beside them took drafts


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash"])
def test_sampled_rounds_through_the_debug_runner_equal_eager(algorithm):
    """graph=debug (the runner's buffers, padding, buckets) replays the sampled round: the same tokens and
    acceptances as the eager rounds, for a batch of 3 in a bucket of 4 (a padding row)."""
    target = tiny_target(max_seq_len=48)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=10, ignore_eos=True)
    prompts, seeds = [[5, 6, 7, 8], [1, 2, 3], [9, 4, 4, 4, 2]], [3, 4, 5]
    eager = Generator(target, 3, draft_for(target, algorithm, 3, 2)[0], 2).generate(prompts, params, seeds=seeds)
    draft, plan, head, cfg = draft_for(target, algorithm, 4, 2)
    gs = GraphSet(target, draft, 4, 2, "debug", "debug", [4], [8], features=True, sampled=True).capture()
    got = Generator(target, 4, make_draft(plan, head, target, 4, 2, cfg=cfg, graphs=gs), 2, graphs=gs)
    res = got.generate(prompts, params, seeds=seeds)
    assert [r.tokens for r in res] == [r.tokens for r in eager] and [r.accepts for r in res] == [
        r.accepts for r in eager
    ]
    assert gs.stats()[round_name(2, True)].replays > 0 and gs.stats()[round_name(2, True)].fallbacks == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algorithm", ["eagle3", "eagle", "multi_layer_eagle", "dflash"])
@pytest.mark.parametrize("policy", [("full", "full"), ("full", "breakable")])  # graph=full, graph=bcg
def test_sampled_rounds_under_full_and_bcg_equal_the_debug_runner(algorithm, policy):
    """bf16 on the fused kernels with the Triton attention, every device draft: the captured sampled rounds
    (no break) emit the debug runner's tokens and acceptances, batch 3 in a bucket of 4, and replay without
    a fallback."""
    from helpers.models import pair

    _, target = pair(max_seq_len=64)
    target = target.to("cuda", torch.bfloat16)
    target.init_buffers(torch.device("cuda"))
    target.attention_kernel = True
    target.use_fused_kernels()
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=24, ignore_eos=True)
    prompts, seeds = [[5, 6, 7, 8], [1, 2, 3], [9, 4, 4, 4, 2]], [3, 4, 5]
    aux = {"aux_layer_ids": AUX} if algorithm in ("eagle3", "dflash") else {}  # eagle, MTP: no such key
    cfg = draft_config(algorithm, init="random", num_steps=3, **aux)
    plan = plan_draft(cfg, target.args)
    target.set_aux_layers(plan.aux.input_of if plan.aux else ())
    head = load_head(plan, target, 0, torch.device("cuda"), torch.bfloat16)
    out = {}
    for name, (tp, dp) in {"debug": ("debug", "debug"), "captured": policy}.items():
        draft = make_draft(plan, head, target, 4, 3, cfg=cfg)
        gs = GraphSet(target, draft, 4, 3, tp, dp, [1, 2, 4], [8], features=True, sampled=True).capture()
        gen = Generator(target, 4, make_draft(plan, head, target, 4, 3, cfg=cfg, graphs=gs), 3, graphs=gs)
        res = gen.generate(prompts, params, seeds=seeds)
        out[name] = ([r.tokens for r in res], [r.accepts for r in res])
        assert gs.stats()[round_name(3, True)].replays > 0 and gs.stats()[round_name(3, True)].fallbacks == 0
    assert out["captured"] == out["debug"]


def test_a_sampled_eval_does_not_depend_on_its_batch_size(outputs):
    """The eval stage seeds prompt i from the run's seed and i: at T = 0.8 with an EAGLE3 draft, batches
    of 1 and of 3 give every prompt the same tokens; another run seed gives others."""
    from helpers.runs import compose_cfg

    from pipeline.__main__ import run

    def tokens(*overrides: str) -> list[list[int]]:
        cfg = compose_cfg(
            "model=tiny",
            "+experiment=eagle3",
            "draft.init=random",
            "draft.aux_layer_ids=[1,2,3]",
            "eval.limit=3",
            "eval.max_new_tokens=8",
            "eval.temperature=0.8",
            "eval.baseline=false",
            "eval.warmup=false",
            "device=cpu",
            "tracking=off",
            *overrides,
        )
        return [r.result.tokens for r in run(cfg)["eval_results"]["records"]]

    one = tokens("eval.batch_size=1")
    assert tokens("eval.batch_size=3") == one
    assert tokens("eval.batch_size=3", "seed=1") != one


@pytest.mark.parametrize("algorithm", ["eagle3"])
def test_a_draft_token_is_kept_as_often_as_rejection_sampling_allows(algorithm):
    """Optimal acceptance, not only a lossless output: given the prefill's token v0, the first draft token is
    kept with probability sum_v min(p(v), q(v)) (q: the EAGLE-family draft's first proposal distribution, kept
    in d_q[:, 0] by its prefill, mapped through d2t; p: the target's), within a binomial margin over 6000
    seeds."""
    torch.manual_seed(0)
    target, n, prompt = tiny_target(), 6000, [1, 2, 3]
    draft, *_ = draft_for(target, algorithm, n, 2)
    res = Generator(target, n, draft, 2).generate([prompt] * n, SAMPLED, seeds=list(range(n)))
    v0 = int(torch.tensor([r.tokens[0] for r in res]).mode().values)
    kept = torch.tensor([r.accepts[0] > 0 for r in res if r.tokens[0] == v0]).double()
    one, *_ = draft_for(target, algorithm, 1, 2)
    gen = Generator(target, 1, one, 2)
    seed = next(i for i, r in enumerate(res) if r.tokens[0] == v0)  # a seed whose prefill drew v0
    gen.generate([prompt], SamplingParams(temperature=T, top_p=TOP_P, max_new_tokens=1, ignore_eos=True), seeds=[seed])
    q = one.buf["d_q"][0, 0].double()  # [Vd]: the first proposal's distribution after v0
    if one.vocab_map is not None:  # a draft vocabulary: q onto target ids
        q = torch.zeros(target.args.vocab_size, dtype=torch.float64).index_copy_(
            0, torch.arange(q.shape[0]) + one.head.d2t.cpu(), q
        )
    want = torch.minimum(target_p(target, prompt + [v0]), q).sum().item()
    margin = 4 * (want * (1 - want) / len(kept)) ** 0.5
    assert abs(kept.mean().item() - want) < margin, (algorithm, kept.mean().item(), want, len(kept))


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash"])
def test_the_temperature_factor_draws_the_heads_q_at_that_multiple_of_t(algorithm):
    """One seed and prompt at T = 0.7, top-p 1, with draft.temperature_factor 1 and 2: the target's first
    token is the same (the factor is the draft's alone), and the first proposal's q with factor 2 is q^(1/2)
    renormalised: the head's logits over 1.4 in place of 0.7, and the rounds read 1.4 from d_temperature."""
    target, prompt, seed = tiny_target(), [1, 2, 3], 11
    params = SamplingParams(temperature=T, top_p=1.0, max_new_tokens=1, ignore_eos=True)
    qs, firsts = [], []
    for factor in (None, 2.0):
        draft, *_ = draft_for(target, algorithm, 1, 2, factor=factor)
        gen = Generator(target, 1, draft, 2)
        if algorithm == "dflash":  # its q comes with the round's block: one round
            params = SamplingParams(temperature=T, top_p=1.0, max_new_tokens=2, ignore_eos=True)
        firsts.append(gen.generate([prompt], params, seeds=[seed])[0].tokens[0])
        qs.append(draft.buf["d_q"][0, 0].double())  # [Vd]: the first proposal's distribution
        if factor is not None:  # what the rounds draw at, kept when the row started
            assert draft.buf["d_temperature"][0].item() == pytest.approx(T * factor)
    assert firsts[0] == firsts[1]
    hotter = qs[0].sqrt() / qs[0].sqrt().sum()
    assert torch.allclose(qs[1], hotter, atol=1e-6), (qs[1], hotter)
    assert not torch.allclose(qs[0], qs[1], atol=1e-3)  # the factor changed q
