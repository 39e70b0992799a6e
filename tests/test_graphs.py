"""Graph policies: one test per hazard of DESIGN.md section 7, on CPU through the `debug` backend
(runner logic), and with real CUDA graphs where a GPU is present (marked gpu)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import pair, random_prompts
from helpers.runs import compose_cfg
from helpers.spec import CUDA, POLICIES, poison, setup, spec_generator

from engine.drafts.base import SpecState
from engine.drafts.registry import draft_config, make_draft
from engine.graphs.program import Step
from engine.graphs.runner import CaptureHiddenMode, GraphRunner, GraphStateError, InputSpec
from engine.sampling import Draws, RowSettings, SamplingParams
from engine.speculative.generate import Generator, _features
from engine.speculative.graph_set import GraphSet, round_name
from pipeline.config import to_run_config
from pipeline.plan import PlanError, build_plan

M = CaptureHiddenMode


def target_for(policy: str):
    """The tiny target on the policy's device (debug: CPU, the CUDA policies: the GPU) -> (target, device)."""
    device = "cuda" if policy != "debug" else "cpu"
    _, target = pair()
    target = target.to(device)
    target.init_buffers(torch.device(device))
    return target, device


def decode_runner(target, policy, sizes, batch, device):
    """A target-only runner (the mechanics every runner shares: buckets, padding, slicing, fallback),
    over a cache of its own: [B, 1] decode buckets of the target's program."""
    cache = target.new_cache(batch)
    runner = GraphRunner(
        "decode",
        policy,
        lambda b: target.program(cache.rows(b)),
        {
            "tokens": InputSpec((), torch.long, 0),
            "positions": InputSpec((), torch.long, 0),
            "valid": InputSpec((), torch.bool, False),
        },
        {M.NULL: ("logits",), M.FULL: ("logits", "hidden", "aux", "embeds")},
        M.NULL,
        [(b, 1) for b in sizes],
        torch.device(device),
        target.max_seq_len,
        lambda: {"aux_layer_ids": target.aux_layer_ids},
        torch.cuda.graph_pool_handle() if policy != "debug" else None,
    )
    return runner.capture(), cache


def eager_forward(target, live, kv_len):
    b = live["tokens"].shape[0]
    return target(live["tokens"], live["positions"], target.new_cache(b), valid=live["valid"], kv_len=kv_len)


def live_batch(b, t=4, start=0, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    live = {
        "tokens": torch.randint(0, 256, (b, t), generator=g),
        "positions": torch.arange(start, start + t).expand(b, t),
        "valid": torch.ones(b, t, dtype=torch.bool),
    }
    return {k: v.to(device) for k, v in live.items()}


# ------------------------------------------------------------------------------------------ hazards
def test_hazard_1_aux_capture_after_graph_capture(outputs, monkeypatch):
    # The plan rejects the order ...
    import pipeline.plan as plan_mod

    monkeypatch.setattr(
        plan_mod, "resolve_stage_names", lambda cfg, draft: ["load", "capture_graphs", "configure_aux_capture", "eval"]
    )
    cfg = to_run_config(
        compose_cfg(
            "model=tiny",
            "+experiment=eagle3",
            "draft.init=random",
            "graph=debug",
            "draft.aux_layer_ids=[1,2,3]",
            "device=cpu",
        )
    )
    with pytest.raises(PlanError, match=r"stages='capture_graphs'.*aux_layers"):
        build_plan(cfg, outputs)
    # ... and if forced at run time, the replay is refused instead of returning graphs without aux.
    _, target = pair()
    gs = GraphSet(target, None, 2, 0, "debug", "none", [1, 2], [16], features=False).capture()
    target.set_aux_layers([1, 2])
    with pytest.raises(GraphStateError, match="aux_layer_ids"):
        gs.get(round_name(0))({}, 8, rows=1)


@pytest.mark.parametrize("policy", POLICIES)
def test_hazard_2_reading_buffers_when_graph_did_not_run(policy):
    target, device = target_for(policy)
    runner, _ = decode_runner(target, policy, (1, 2), 4, device)
    poison(runner)
    live = live_batch(4, 1, start=3, device=device)  # 4 rows > largest size 2
    out, ran = runner(live, 8, M.NULL)
    assert not ran and runner.stats.fallbacks == 1
    ref = eager_forward(target, live, 8).logits
    assert torch.isfinite(out["logits"]).all() and torch.allclose(out["logits"], ref, atol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_hazard_3_padded_rows_do_not_leak(policy):
    target, device = target_for(policy)
    runner, cache = decode_runner(target, policy, (4,), 4, device)
    runner.buffers["tokens"].fill_(255)  # garbage in the padding rows' inputs
    runner.buffers["positions"].fill_(7)
    cache.k[:, 3].fill_(123.0)  # row 3 is padding in a batch of 3: it must stay untouched
    live = live_batch(3, 1, start=0, device=device)
    out, ran = runner(live, 1, M.NULL)
    assert ran and out["logits"].shape[0] == 3  # sliced to the live rows
    ref = eager_forward(target, live, 1).logits
    assert torch.allclose(out["logits"], ref, atol=1e-4)
    assert (cache.k[:, 3, :, : target.max_seq_len] == 123.0).all()  # only the dummy slot was written


@pytest.mark.parametrize("policy", POLICIES)
def test_hazard_3_a_round_writes_no_padding_row(policy):
    """A round over 3 live rows in a bucket of 4: the padding row writes only dummy slots, its state
    stays inert, and the live rows' output equals the eager round's."""
    device = "cuda" if policy != "debug" else "cpu"
    target, plan, head, gs, k = setup("eagle3", policy=policy, device=device, sizes=(4,), batch=4)
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    gs.cache.k[:, 3].fill_(123.0)
    gs.draft.cache.k[:, 3].fill_(123.0)
    prompts = random_prompts(3, seed=5)
    got = [r.tokens for r in spec_generator(target, plan, head, gs, k, 4, params).generate(prompts, params)]
    assert got == [r.tokens for r in Generator(target, 3).generate(prompts, params)]
    assert gs.stats()[round_name(k)].replays > 0
    assert (gs.cache.k[:, 3, :, : target.max_seq_len] == 123.0).all()
    assert (gs.draft.cache.k[:, 3, :, : target.max_seq_len] == 123.0).all()
    assert int(gs.buffers["lengths"][3]) == 0 and not bool(gs.buffers["live"][3])


@pytest.mark.parametrize("policy", POLICIES)
def test_hazard_4_stale_static_buffers(policy):
    target, device = target_for(policy)
    runner, _ = decode_runner(target, policy, (4,), 4, device)
    a = live_batch(4, 1, seed=1, device=device)
    runner(a, 1, M.NULL)
    b = live_batch(2, 1, seed=2, device=device)  # smaller: rows 2, 3 hold A's inputs
    out, ran = runner(b, 1, M.NULL)
    assert ran and torch.allclose(out["logits"], eager_forward(target, b, 1).logits, atol=1e-4)


@pytest.mark.parametrize("policy", POLICIES)
def test_hazard_5_outputs_not_overwritten_by_next_replay(policy):
    target, device = target_for(policy)
    runner, _ = decode_runner(target, policy, (2,), 2, device)
    step_n = live_batch(2, 1, seed=3, device=device)
    out_n, _ = runner(step_n, 1, M.NULL)
    kept = out_n["logits"]
    runner(live_batch(2, 1, seed=4, device=device), 1, M.NULL)  # step N + 1
    assert torch.allclose(kept, eager_forward(target, step_n, 1).logits, atol=1e-4)


def test_hazard_7_draft_graphs_before_weight_sharing():
    target, plan, head, gs, k = setup("eagle3", sizes=(2,), batch=2)
    # A head whose embedding is a copy (not yet shared) when its graphs are captured ...
    copy = torch.nn.Embedding.from_pretrained(target.model.embed_tokens.weight.clone())
    head.embed_ref = [copy]
    draft = make_draft(plan, head, target, 2, k)
    gs2 = GraphSet(target, draft, 2, k, "debug", "debug", [2], [16], features=True).capture()
    head.bind(target)  # ... then shared: the graphs point at the copy's memory
    with pytest.raises(GraphStateError, match="embed_ptr"):
        gs2.get(round_name(k))({}, 4, rows=2)
    # The capture stage refuses a head that does not share the target's embedding.
    from stages.capture_graphs import CaptureGraphsStage

    head.embed_ref = [copy]
    cfg = to_run_config(
        compose_cfg("model=tiny", "+experiment=eagle3", "draft.init=random", "graph=debug", "device=cpu")
    )

    class Env:
        draft_plan, tracker = plan, None

    with pytest.raises(RuntimeError, match="does not share the target's embedding"):
        CaptureGraphsStage().run(cfg, {"target": type("T", (), {"model": target})(), "draft_head": head}, Env())


@pytest.mark.parametrize("policy", ["debug"] + (["piecewise"] if CUDA else []))
def test_hazard_8_input_embeds_survive_piecewise_replay(policy):
    target, device = target_for(policy)
    gs = GraphSet(target, None, 2, 0, policy, "none", [1, 2], [16, 32], features=True)
    gs.runners["prefill"] = gs.runners.get("prefill") or GraphRunner(
        "prefill",
        policy,
        lambda b: target.program(gs.cache.rows(b), embeds_input=True, logits_at_index=True),
        {
            "tokens": InputSpec((), torch.long, 0),
            "positions": InputSpec((), torch.long, 0),
            "valid": InputSpec((), torch.bool, False),
            "input_embeds": InputSpec((64,), torch.float32, 0),
            "logits_index": InputSpec((), torch.long, 0, per_row=True),
        },
        {M.FULL: ("logits", "hidden", "aux", "embeds")},
        M.FULL,
        [(2, 16), (2, 32)],
        torch.device(device),
        target.max_seq_len,
        lambda: {"aux_layer_ids": target.aux_layer_ids},
    )
    runner = gs.get("prefill").capture()
    t = 11  # live tokens per row, padded to the 16-token bucket
    embeds = torch.randn(2, t, 64, device=device)
    live = {
        **live_batch(2, t, device=device),
        "input_embeds": embeds,
        "logits_index": torch.tensor([t - 1, t - 1], device=device),
    }
    out, ran = runner(live, t, M.FULL)
    assert ran and out["embeds"].shape == (2, t, 64) and torch.equal(out["embeds"], embeds)
    assert out["hidden"].shape == (2, t, 64)
    ref = target(
        live["tokens"],
        live["positions"],
        target.new_cache(2),
        kv_len=t,
        input_embeds=embeds,
        logits_index=live["logits_index"],
    )
    assert torch.allclose(out["logits"], ref.logits, atol=1e-4)


@pytest.mark.parametrize("policy", ["debug"] + (["full", "breakable"] if CUDA else []))
@pytest.mark.parametrize("staging", [None, 1])
def test_prefill_graphs_under_every_policy_and_into_any_row(policy, staging):
    """The prefill graphs exist under every policy. Without staging they write rows 0..b-1 of the round
    cache (an eval batch); with a staging row (a server) a prompt joins at any slot: the graph runs over
    the staging cache and the KV is copied into the slot. Either way logits, features and the KV of the
    rows written equal an eager prefill, the other rows' slots are untouched, and a prompt no bucket holds
    prefills eagerly."""
    target, device = target_for(policy)
    gs = GraphSet(target, None, 3, 0, policy, "none", [1, 2, 3], [8, 16], features=True, prefill_rows=staging).capture()
    dec = Generator(target, 3, graphs=gs)
    dec.mode = M.FULL  # the features too, as for a draft that reads them
    runner = gs.get("prefill")
    for prompts, rows, replayed in [
        ([[5, 7, 11, 13, 17]], slice(2, 3) if staging else None, True),
        ([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1]], None, not staging),
        ([list(range(1, 20))], slice(1, 2) if staging else None, False),
    ]:
        sl = rows or slice(0, len(prompts))
        dec.cache.k.fill_(0.5)
        before, replays = dec.cache.k.clone(), runner.stats.replays
        pre = dec.prefill(prompts, None, rows)
        assert (runner.stats.replays == replays + 1) == replayed
        ref_cache = target.new_cache(3)
        ref = target(
            pre.tokens,
            torch.arange(pre.tokens.shape[1], device=device).expand_as(pre.tokens),
            ref_cache.rows(sl),
            valid=pre.valid,
            kv_len=pre.tokens.shape[1],
            logits_index=pre.valid.sum(1) - 1,
        )
        assert torch.allclose(pre.out.logits, ref.logits, atol=1e-4)
        valid = pre.valid[..., None]
        assert torch.allclose(pre.out.hidden_states * valid, ref.hidden_states * valid, atol=1e-4)
        for i, n in enumerate(len(p) for p in prompts):
            row = sl.start + i
            assert torch.allclose(dec.cache.k[:, row, :, :n], ref_cache.k[:, row, :, :n], atol=1e-4)
        others = [r for r in range(3) if not sl.start <= r < sl.stop]  # (padding rows write the dummy slot)
        assert torch.equal(dec.cache.k[:, others, :, :-1], before[:, others, :, :-1])


@pytest.mark.parametrize("policy", ["debug"] + (["full"] if CUDA else []))
def test_prompts_prefill_together_into_any_rows(policy):
    """Two staging rows: prompts that fit the joint buckets (2 x 8) prefill in one replay into any rows,
    in any order; more prompts than the staging rows go through them in groups; a prompt past the joint
    buckets goes alone. Logits and each row's KV equal an eager prefill of the prompt alone; rows no
    prompt names are untouched."""
    target, device = target_for(policy)
    gs = GraphSet(target, None, 4, 0, policy, "none", [1, 2, 4], [8, 16], features=True, prefill_rows=2).capture()
    runner = gs.get("prefill")
    assert sorted(runner.buckets) == [(1, 8), (1, 16), (2, 8)]
    dec = Generator(target, 4, graphs=gs)
    short, longer = [[5, 7, 11], [3, 1, 4, 1, 5, 9], [2, 7, 1, 8]], [list(range(1, 13))]
    for prompts, rows, replays in [
        (short[:2], [3, 0], 1),  # out of order, not contiguous: one replay
        (short, [0, 2, 3], 2),  # three prompts: a group of two, then one
        (short[:1] + longer, [1, 2], 2),  # the 12-token prompt only fits a one-row bucket: each alone
    ]:
        dec.cache.k.fill_(0.5)
        before, seen = dec.cache.k.clone(), runner.stats.replays
        pre = dec.prefill(prompts, None, rows)
        assert runner.stats.replays - seen == replays and runner.stats.fallbacks == 0
        for j, (p, row) in enumerate(zip(prompts, rows)):
            ref_cache = target.new_cache(1)
            tokens = torch.tensor([p], device=device)
            ref = target(
                tokens,
                torch.arange(len(p), device=device)[None],
                ref_cache,
                kv_len=len(p),
                logits_index=torch.tensor([len(p) - 1], device=device),
            )
            assert torch.allclose(pre.out.logits[j], ref.logits[0], atol=1e-4)
            assert pre.valid[j].sum() == len(p) and pre.tokens[j, : len(p)].tolist() == p
            assert torch.allclose(dec.cache.k[:, row, :, : len(p)], ref_cache.k[:, 0, :, : len(p)], atol=1e-4)
        others = [r for r in range(4) if r not in rows]
        assert torch.equal(dec.cache.k[:, others], before[:, others])


@pytest.mark.parametrize("policy", POLICIES)
def test_hazard_9_sampling_inside_a_graph_draws_anew(policy):
    device = torch.device("cuda" if policy != "debug" else "cpu")

    def draw(env):
        probs = torch.softmax(env["tokens"].float(), -1)  # [b, t]
        env["logits"] = (probs / torch.empty_like(probs).exponential_(1.0)).argmax(-1, keepdim=True)

    runner = GraphRunner(
        "sample",
        policy,
        lambda b: [Step("sample", draw)],
        {"tokens": InputSpec((), torch.long, 0), "positions": InputSpec((), torch.long, 0)},
        {M.NULL: ("logits",), M.FULL: ("logits",)},
        M.NULL,
        [(64, 16)],
        device,
        16,
        lambda: {},
    ).capture()
    live = {
        "tokens": torch.zeros(64, 16, dtype=torch.long, device=device),
        "positions": torch.zeros(64, 16, dtype=torch.long, device=device),
    }
    a, ran_a = runner(live, 16)
    b, ran_b = runner(live, 16)
    assert ran_a and ran_b and not torch.equal(a["logits"], b["logits"])  # uniform over 16: equal is ~0 odds


def test_hazard_10_capture_sizes_not_covering_verify_batches(outputs):
    cfg = to_run_config(
        compose_cfg(
            "model=tiny",
            "+experiment=ngram",
            "graph=debug",
            "graph.capture_sizes=[1,2]",
            "eval.batch_size=4",
            "device=cpu",
        )
    )
    plan = build_plan(cfg, outputs)
    text = plan.describe()
    assert "capture sizes [1, 2] (verify tokens [4, 8])" in text
    assert "batches of 3..4 rows (12+ verify tokens) exceed the largest capture size 2: they run eagerly" in text
    # and at run time those batches are counted as fallbacks, not silently dropped
    from pipeline.__main__ import run

    ctx = run(
        compose_cfg(
            "model=tiny",
            "+experiment=ngram",
            "graph=debug",
            "graph.capture_sizes=[1,2]",
            "eval.batch_size=4",
            "eval.limit=4",
            "eval.max_new_tokens=8",
            "device=cpu",
            "tracking=off",
        )
    )
    m = ctx["eval_results"]["metrics"]
    assert m["graph_fallbacks.round_k3"] > 0 and m["graph_replays.round_k3"] == 0 and m["match_baseline"] == 1.0


def test_cuda_policy_on_a_cpu_host_names_the_fix(outputs):
    if CUDA:
        pytest.skip("checks the error on a host without CUDA")
    cfg = to_run_config(compose_cfg("model=tiny", "graph=full", "device=cpu"))
    with pytest.raises(PlanError, match=r"graph.target_policy='full'.*graph=none.*graph=debug"):
        build_plan(cfg, outputs)


# ------------------------------------------------------------------------------------------ lossless
@pytest.mark.parametrize("algorithm", ["none", "eagle3", "eagle", "multi_layer_eagle", "ngram", "oracle"])
@pytest.mark.parametrize("policy", POLICIES + (["bcg"] if CUDA else []))
def test_every_policy_equals_eager(algorithm, policy):
    """Batches of 2 replay the round's graphs, batches of 3 fall back (above the largest capture size 2)
    after the graphs' own tensors were poisoned with NaN: both equal the eager baseline (hazard 2)."""
    device = "cuda" if policy != "debug" else "cpu"
    kw = dict(policy="full", draft_policy="breakable") if policy == "bcg" else dict(policy=policy)
    target, plan, head, gs, k = setup(algorithm, device=device, sizes=(1, 2), batch=4, **kw)
    prompts = random_prompts(5, seed=21)
    params = SamplingParams(max_new_tokens=17, ignore_eos=True)
    eager = Generator(target, 4)
    base = [r.tokens for r in eager.generate(prompts[:2], params)] + [
        r.tokens for r in eager.generate(prompts[2:], params)
    ]
    gen = spec_generator(target, plan, head, gs, k, 4, params, references=base, prompts=prompts)
    got = [r.tokens for r in gen.generate(prompts[:2], params, row_ids=[0, 1])]  # captured bucket 2
    poison(gs.get(round_name(k)))
    got += [r.tokens for r in gen.generate(prompts[2:], params, row_ids=[2, 3, 4])]  # 3 rows: eager fallback
    assert got == base
    stats = gs.stats()[round_name(k)]
    assert stats.replays > 0 and stats.fallbacks > 0


@pytest.mark.parametrize("algorithm", ["eagle3", "multi_layer_eagle"])
def test_hazard_12_a_replay_after_a_fallback_reads_what_the_fallback_wrote(algorithm):
    """Rounds alternate between the graph and the eager fallback within one generation: the chain's
    first token and carried hidden state come from the state buffers, which the fallback writes too."""
    target, plan, head, gs, k = setup(algorithm, sizes=(2,), batch=2)
    runner = gs.get(round_name(k))
    prompts = random_prompts(2, seed=22)
    params = SamplingParams(max_new_tokens=21, ignore_eos=True)
    base = [r.tokens for r in Generator(target, 2).generate(prompts, params)]
    gen = spec_generator(target, plan, head, gs, k, 2, params)
    inner, buckets, calls = gen.run_round, runner.buckets, []

    def alternate(*a, **kw):
        calls.append(1)
        runner.buckets = buckets if len(calls) % 2 else []  # even rounds: no bucket, the eager fallback
        if not len(calls) % 2:
            poison(runner)
        return inner(*a, **kw)

    gen.run_round = alternate
    assert [r.tokens for r in gen.generate(prompts, params)] == base
    assert runner.stats.replays > 1 and runner.stats.fallbacks > 1


@pytest.mark.parametrize("policy", ["debug", *(pytest.param(p, marks=pytest.mark.gpu) for p in ("full", "breakable"))])
@pytest.mark.parametrize("algorithm", ["eagle3", "eagle", "multi_layer_eagle", "dflash"])
@pytest.mark.parametrize("staging", [None, 1, 2])
def test_draft_prefill_graphs_equal_an_eager_begin_in_any_row(policy, algorithm, staging):
    """A device draft's prefill replays its graphs (greedy, and `_sampled` for a row that samples): into
    rows 0..b-1 of its cache (an eval batch) or, with staging rows (a server), at any slot, the KV copied
    there, as many prompts a replay as the staging rows hold at their width. The draft's state rows (its
    buffers, d_q's first column) and cache rows equal an eager `begin` of the same draft on the same
    features, other rows stay untouched, and a prompt no bucket holds (or a row the graphs cannot write)
    runs eagerly."""
    if policy != "debug" and not CUDA:
        pytest.skip("needs CUDA")
    target, plan, head, gs, k = setup(
        algorithm,
        policy,
        sizes=(1, 2, 3),
        batch=3,
        prefill=(8, 16),
        prefill_rows=staging,
        sampled=True,
        device="cuda" if policy != "debug" else "cpu",
    )
    dec = spec_generator(target, plan, head, gs, k, 3, SamplingParams())
    ref = make_draft(
        plan, head, target, 3, k, cfg=draft_config(plan.algorithm, num_steps=k)
    )  # eager, its own cache and buffers
    draft, sampled_runner = gs.draft, gs.get("draft_prefill_sampled")
    assert (sampled_runner is not None) == draft.draws_at_prefill
    greedy, temp = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)
    for prompts, rows, params, replays in [
        ([[5, 7, 11, 13, 17, 19, 23, 29]], slice(2, 3) if staging else None, greedy, 1),  # the bucket's width
        ([[3, 1, 4, 1, 5]], slice(1, 2) if staging else None, temp, 1),
        ([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1]], None, greedy, 2 if staging else 1),  # staged: one at a time
        ([[3, 1, 4], [2, 7, 1, 8], [9, 9]], None, temp, {None: 1, 1: 3, 2: 2}[staging]),  # staged: two, then one
        ([[2, 7, 1, 8, 2]], slice(1, 2), greedy, int(bool(staging))),  # not rows 0..b-1 of the draft's own cache
        ([list(range(1, 20))], slice(0, 1), greedy, 0),  # longer than every bucket
    ]:
        n, sl = len(prompts), rows or slice(0, len(prompts))
        for c in (draft.cache, ref.cache):
            for kv in c.caches if hasattr(c, "caches") else [c]:
                kv.k.fill_(0.5)
        before = [t.clone() for _, t in _draft_kv(draft)]
        runner = gs.get("draft_prefill_sampled" if params.temperature and draft.draws_at_prefill else "draft_prefill")
        replays += runner.stats.replays
        state = SpecState([list(p) for p in prompts], [len(p) for p in prompts], [True] * n, list(range(n)), "cpu")
        pre = dec.prefill(prompts, None, rows)
        settings = RowSettings.uniform(params, [3 + i for i in range(n)])
        first = dec.start(state, pre, settings, rows)
        assert runner.stats.replays == replays
        draws = (
            None if not params.temperature else Draws(*(dec.buffers[x][sl] for x in ("temperature", "top_p", "seed")))
        )
        ref.begin(None, _features(pre.out, draft.features), pre.tokens, pre.valid, None, first, rows, draws)
        exact = pre.tokens.shape[1] in (8, 16) and policy == "debug"  # no padded column: the same maths
        for name in draft.buf:
            if name == "d_q" and not (params.temperature and draft.draws_at_prefill):
                continue
            got, want = draft.buf[name][sl], ref.buf[name][sl]
            got, want = (got[:, :1], want[:, :1]) if name == "d_q" else (got, want)
            assert (
                torch.equal(got, want) if exact or not got.is_floating_point() else torch.allclose(got, want, atol=1e-3)
            ), (name, prompts, (got.float() - want.float()).abs().max(), got, want)
        for (module, got), (_, want), old in zip(_draft_kv(draft), _draft_kv(ref), before):
            for i, p in enumerate(prompts):  # multi-layer module i prefills positions 0..L-1-i
                row, n_kv = sl.start + i, len(p) - module
                assert torch.allclose(got[:, row, :, :n_kv], want[:, row, :, :n_kv], atol=1e-3)
            others = [r for r in range(3) if not sl.start <= r < sl.stop]
            assert torch.equal(got[:, others, :, :-1], old[:, others, :, :-1])


def _draft_kv(draft) -> list[tuple[int, torch.Tensor]]:
    """(module, tensor) for every key and value tensor of a draft's cache (a module each: multi-layer)."""
    caches = draft.cache.caches if hasattr(draft.cache, "caches") else [draft.cache]
    return [(i, t) for i, c in enumerate(caches) for t in (c.k, c.v)]
