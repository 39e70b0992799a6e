"""The round (engine/speculative/round.py): its phases and eager calls per policy, the on-device
acceptance against `verify`, every draft on the fused kernels (under TRITON_INTERPRET=1 on CPU)
lossless and equal to its unfused self, and the state buffers a round advances by itself."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.models import pair, random_prompts
from helpers.spec import AUX, build, setup, spec_generator, weights

from engine.drafts.registry import draft_config, load_head, make_draft, plan_draft
from engine.graphs.breakable import Capture
from engine.graphs.program import run_steps
from engine.model import Attention
from engine.sampling import Draws, SamplingParams
from engine.speculative.generate import Generator
from engine.speculative.graph_set import round_name
from engine.speculative.round import round_buffers, round_program
from engine.speculative.verify import accept_greedy, verify, verify_greedy

CUDA = torch.cuda.is_available()
KERNELS = CUDA or os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------------------ program
@pytest.mark.parametrize("algorithm", ["eagle3", "multi_layer_eagle", "dflash"])
def test_a_round_is_three_phases_and_breaks_only_where_it_must(algorithm):
    """Phases draft -> verify -> extend, one graph each under full; under breakable with SDPA each
    attention runs eagerly and nothing else does; with the Triton attention (each row's live length read
    on the device) nothing of a greedy or sampled round does; a side under policy none runs eagerly."""
    _, target = pair()
    cfg = draft_config(algorithm, num_steps=3, **weights(algorithm, ("eagle3", "dflash")))
    plan = plan_draft(cfg, target.args)
    target.set_aux_layers(plan.aux.input_of if plan.aux else ())
    head = load_head(plan, target, 0, torch.device("cpu"), torch.float32)
    draft = make_draft(plan, head, target, 2, 3, cfg=cfg)

    def program(policy, sampled=False, draft_policy=None):
        return round_program(
            target,
            target.new_cache(2),
            draft,
            3,
            2,
            sampled=sampled,
            target_policy=policy,
            draft_policy=draft_policy or policy,
        )

    buffers = round_buffers(3, draft, 2, torch.device("cpu"))
    buffers["live"].fill_(False)  # every write goes to the dummy slot

    def capture(policy, sampled=False, draft_policy=None) -> list[tuple[str, str, object]]:
        """(phase, kind, what) of each part of the round under a breakable capture (dry): kind graph, or
        call (what: the eager call's first argument, an Attention module or a whole side's RoundState)."""
        env = {**buffers, "kv_len": 8}
        steps = program(policy, sampled, draft_policy)
        with torch.inference_mode():
            parts = Capture(None, torch.device("cpu"), dry=True).run(lambda: run_steps(steps, dict(env))).parts
        return [(phase, kind, part[1][0] if kind == "call" else None) for kind, phase, part in parts]

    def eager_parts(*args, **kw):
        return [p for p in capture(*args, **kw) if p[1] != "graph"]

    assert capture("full") == [(p, "graph", None) for p in ("draft", "verify", "extend")]  # one graph per phase
    breakable = eager_parts("breakable")  # SDPA over the live kv_len: every attention, only the attentions
    assert {p for p, _, _ in breakable} >= {"draft", "verify"}
    assert all(kind == "call" and isinstance(m, Attention) for _, kind, m in breakable)
    assert sum(p == "verify" for p, _, _ in breakable) == target.args.num_layers
    target.attention_kernel = head.attention_kernel = True  # each row's live length read on the device
    try:
        assert eager_parts("breakable") == [] and eager_parts("breakable", sampled=True) == []
    finally:
        target.attention_kernel = head.attention_kernel = False
    mixed = eager_parts("full", draft_policy="none")  # a side without graphs: its work runs eagerly, whole
    assert [(p, type(s).__name__) for p, _, s in mixed] == [("draft", "RoundState"), ("extend", "RoundState")]


def test_a_sampled_round_runs_before_any_row_starts():
    """A graph's warm-up and capture run the sampled round over state buffers no row has started in
    (temperature 0 everywhere: every row greedy): it runs and writes an acceptance per row."""
    target, plan, head, gs, k = setup("eagle3", sizes=(2,), batch=2)
    program = round_program(target, gs.cache, gs.draft, k, 2, sampled=True, target_policy="full", draft_policy="full")
    env = {name: t[:2] for name, t in gs.buffers.items()}
    env["live"].fill_(False)
    env["out"].fill_(-1)
    with torch.inference_mode():
        run_steps(program, {**env, "kv_len": 8})
    a = env["out"][:, 0]
    assert ((a >= 0) & (a <= k)).all()  # written: an acceptance per row


def test_greedy_acceptance_on_the_device_equals_verify():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 6, 50, generator=g)
    target = logits.argmax(-1)
    draft = target[:, :5].clone()  # accepted up to a random depth per row, then a wrong token
    depth = torch.randint(0, 6, (64,), generator=g)
    rows = depth < 5
    draft[rows, depth[rows]] = (draft[rows, depth[rows]] + 1) % 50
    a, bonus = accept_greedy(target, draft)
    assert torch.equal(a, depth)
    assert torch.equal((a, bonus)[0], verify_greedy(logits, draft)[0])
    assert torch.equal(bonus, target[torch.arange(64), depth])


@pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("k", [1, 3, 5])
def test_accept_and_advance_kernels_equal_their_references(k):
    """kernels/accept.py: the whole greedy acceptance (a, the bonus, the emitted row) and the state's
    advance in one launch each, against plain torch: every depth 0..k, drafts as a strided view."""
    from kernels.accept import accept_greedy as accept_kernel
    from kernels.accept import advance, advance_reference

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(k)
    b = 40
    target = torch.randint(0, 9, (b, k + 1), generator=g)
    drafts = torch.randint(0, 9, (b, k + 3), generator=g)  # a wider buffer: the round's draft columns
    depth = torch.arange(b) % (k + 1)
    for r in range(b):  # row r accepts exactly depth[r] drafts
        drafts[r, : depth[r]] = target[r, : depth[r]]
        if depth[r] < k:
            drafts[r, depth[r]] = (target[r, depth[r]] + 1) % 9
    target, drafts = target.to(device), drafts.to(device)
    out = torch.full((b, k + 4), -7, dtype=torch.long, device=device)
    a, bonus = accept_kernel(target, drafts[:, :k], out)
    ra, rbonus = accept_greedy(target, drafts[:, :k])
    assert torch.equal(a, ra) and torch.equal(a.cpu(), depth) and torch.equal(bonus, rbonus)
    emitted = torch.cat([drafts[:, :k], rbonus[:, None]], 1)
    emitted[torch.arange(b), ra] = rbonus
    assert torch.equal(out[:, 1 : k + 2], emitted) and (out[:, k + 2 :] == -7).all()  # nothing past k + 2
    speculate = (torch.arange(b) % 4 != 1).to(device)  # rows that do not speculate: a = 0, bonus = target[0]
    sa, sbonus = accept_kernel(target, drafts[:, :k], out, speculate)
    ra, rbonus = accept_greedy(target, drafts[:, :k], speculate)
    assert torch.equal(sa, ra) and torch.equal(sbonus, rbonus) and (sa[~speculate] == 0).all()
    assert torch.equal(sbonus[~speculate], target[~speculate, 0]) and torch.equal(sa[speculate], a[speculate])
    lengths = torch.randint(5, 50, (b,), generator=g).to(device)
    last = torch.randint(0, 9, (b,), generator=g).to(device)
    live = (torch.arange(b) % 3 != 0).to(device)
    want = [lengths.clone(), last.clone()]
    advance_reference(*want, live, a, bonus)
    advance(lengths, last, live, a, bonus)
    assert torch.equal(lengths, want[0]) and torch.equal(last, want[1])


def test_sampled_accept_keeps_greedy_rows_greedy_and_a_one_hot_q_is_no_q():
    """The sampled accept (`verify`): greedy rows of a mixed batch keep the greedy rule exactly; a host
    draft's missing q is a one-hot q (the same draws)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 4, 30, generator=g)
    draft = torch.randint(0, 30, (8, 3), generator=g)
    draft[0::4, :2] = logits[0::4, :2].argmax(-1)  # greedy rows 0 and 4 accept two
    rows = Draws(torch.tensor([0.0, 1.0] * 4), torch.tensor([1.0, 0.9] * 4), torch.arange(8))
    lengths = torch.randint(3, 20, (8,), generator=g)
    a, bonus = verify(logits, draft, None, rows, lengths)
    q = torch.nn.functional.one_hot(draft, 30).float()
    assert all(torch.equal(x, y) for x, y in zip((a, bonus), verify(logits, draft, q, rows, lengths)))
    ga, gb = verify_greedy(logits, draft)
    assert torch.equal(a[0::2], ga[0::2]) and torch.equal(bonus[0::2], gb[0::2]) and min(a[0], a[4]) >= 2


# ------------------------------------------------------------------------------------------ state
def test_a_round_advances_its_state_on_the_device():
    """After each round the buffers hold what the host mirror says: lengths, and the last emitted
    token as `last`; rows that finished stay where they stopped."""
    target, plan, head, gs, k = setup("eagle3", sizes=(2,), batch=2)
    params = SamplingParams(max_new_tokens=13, ignore_eos=True)
    gen = spec_generator(target, plan, head, gs, k, 2, params)
    seen = []
    inner = gen.round

    def round_and_check(state, rows=None):
        r = inner(state, rows)
        seen.append((list(state.lengths), [h[-1] for h in state.history], list(state.live)))
        return r

    gen.round = round_and_check
    res = gen.generate(random_prompts(2, seed=3), params)
    assert len(seen) > 2
    lengths, last, live = seen[-1]
    assert gs.buffers["lengths"][:2].tolist() == lengths
    assert gs.buffers["last"][:2].tolist() == last
    assert [len(r.tokens) for r in res] == [13, 13]


# ------------------------------------------------------------------------------------------ fused
def _fused_pair(algorithm, device):
    """(plain generator, fused generator) over the same random target and head: the fused one with
    the Triton attention and fused kernels on the target and (through the draft) on the head."""
    # a cache of 65 slots: two blocks of 64, so attention still splits and combines; 4 new tokens: 3 rounds
    _, target = pair(max_seq_len=64)
    target = target.to(device)
    target.init_buffers(torch.device(device))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    gen = build(target, algorithm, 2, params)
    head = gen.draft.head
    fused_target = pair(max_seq_len=64)[1].to(device)
    fused_target.init_buffers(torch.device(device))
    fused_target.set_aux_layers(target.aux_layer_ids)
    fused_target.attention_kernel = True
    fused_target.use_fused_kernels()
    fhead = head.copy(device)
    fhead.bind(fused_target)
    cfg = draft_config(algorithm, num_steps=3, **weights(algorithm, ("eagle3", "dflash")))
    plan = plan_draft(cfg, fused_target.args)
    fdraft = make_draft(plan, fhead, fused_target, 2, 3, cfg=cfg)
    assert fhead.fused and fhead.attention_kernel
    return gen, Generator(fused_target, 2, fdraft, 3), params


FUSED_PROMPTS = random_prompts(2, seed=85)  # 6 and 8 tokens: a short prefill, rows of different lengths


@pytest.fixture(scope="module")
def fused_eagle3():
    """The EAGLE3 pair of `_fused_pair` and the fused target's own greedy output on FUSED_PROMPTS,
    computed once for the tests below (an interpreted generation takes tens of seconds on CPU)."""
    device = "cuda" if CUDA else "cpu"
    plain, fused, params = _fused_pair("eagle3", device)
    base = [r.tokens for r in Generator(fused.model, 2).generate(FUSED_PROMPTS, params)]
    return plain, fused, params, base


@pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("algorithm", ["eagle3", "eagle", "multi_layer_eagle", "dflash"])
def test_every_draft_on_the_fused_kernels_is_lossless_and_proposes_what_the_plain_path_does(algorithm, request):
    """Every draft on CUDA; on CPU (the interpreter runs a kernel launch in tens of ms) EAGLE3 alone."""
    if not CUDA and algorithm != "eagle3":
        pytest.skip("the interpreter is slow: EAGLE3 on CPU, every draft on a GPU")
    if algorithm == "eagle3":
        plain, fused, params, base = request.getfixturevalue("fused_eagle3")
    else:
        plain, fused, params = _fused_pair(algorithm, "cuda" if CUDA else "cpu")
        base = [r.tokens for r in Generator(fused.model, 2).generate(FUSED_PROMPTS, params)]
    got = fused.generate(FUSED_PROMPTS, params)
    assert [r.tokens for r in got] == base  # lossless against the fused target's own greedy output
    want = plain.generate(FUSED_PROMPTS, params)
    assert [r.tokens for r in want] == base  # the plain path: the same target output (fp32: no tie flips)
    assert [r.accepts for r in got] == [r.accepts for r in want]  # and the same proposals round by round


@pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_a_sampled_round_on_the_fused_kernels_draws_what_the_plain_path_draws(fused_eagle3):
    """EAGLE3, T = 0.8, top-p 0.9, the same seeds: the fused round (the sampling and acceptance kernels,
    the head's lm_head without its argmax epilogue) emits the plain path's tokens with the same
    acceptances (fp32: the kernels draw what their references draw, but at float ties)."""
    plain, fused, _, _ = fused_eagle3
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=4, ignore_eos=True)
    want = plain.generate(FUSED_PROMPTS, params, seeds=[1, 2])
    got = fused.generate(FUSED_PROMPTS, params, seeds=[1, 2])
    assert [r.tokens for r in got] == [r.tokens for r in want] and [r.accepts for r in got] == [r.accepts for r in want]


@pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_the_fused_round_replays_through_the_debug_runner(fused_eagle3):
    """The fused target and EAGLE3 draft through the round runner (debug backend: the runner's buffers,
    padding and bucket logic) equal the eager fused round."""
    from engine.speculative.graph_set import GraphSet

    _, fused, params, base = fused_eagle3
    target, head = fused.model, fused.draft.head
    cfg = draft_config("eagle3", init="random", num_steps=3, aux_layer_ids=AUX)
    plan = plan_draft(cfg, target.args)
    draft = make_draft(plan, head, target, 2, 3, cfg=cfg)
    gs = GraphSet(target, draft, 2, 3, "debug", "debug", [2], [8], features=True).capture()  # the prompts pad to 8
    got = [r.tokens for r in Generator(target, 2, draft, 3, graphs=gs).generate(FUSED_PROMPTS, params)]
    assert got == base
    assert gs.stats()[round_name(3)].replays > 0


# ------------------------------------------------------------------------------------------ adaptive k
def test_adaptive_k_rounds_switch_k_and_stay_lossless():
    """Rounds of a batch of 1 draft 3 tokens and rounds of 4 rows none (the table), through the round
    runner (debug backend: every k captured) and its eager fallback; the output is the target's."""
    from engine.speculative.adaptive_k import AdaptiveK
    from engine.speculative.graph_set import GraphSet

    _, target = pair()
    cfg = draft_config("eagle3", init="random", num_steps=3, aux_layer_ids=AUX)
    plan = plan_draft(cfg, target.args)
    target.set_aux_layers(plan.aux.input_of)
    head = load_head(plan, target, 0, torch.device("cpu"), torch.float32)
    draft = make_draft(plan, head, target, 4, 3, cfg=cfg)
    gs = GraphSet(target, draft, 4, 3, "debug", "debug", [1, 4], [16], features=True, round_ks=[0, 1, 2, 3]).capture()
    gen = Generator(target, 4, draft, 3, graphs=gs)
    table = gen.enable_adaptive_k([1, 4]).table()  # measured: a table over both sizes
    assert set(table) == {1, 4} and all(0 <= k <= 3 for k in table.values())
    gen.adaptive = AdaptiveK({1: {0: 1.0, 3: 1.01}, 4: {0: 1.0, 3: 9.0}}, 3)  # then a known one
    params = SamplingParams(max_new_tokens=11, ignore_eos=True)
    prompts = random_prompts(5, seed=16)
    base = [r.tokens for r in Generator(target, 4).generate(prompts[:1], params)]
    base += [r.tokens for r in Generator(target, 4).generate(prompts[1:], params)]
    got = [r.tokens for r in gen.generate(prompts[:1], params)] + [r.tokens for r in gen.generate(prompts[1:], params)]
    assert got == base
    assert set(gen.ks_used) == {0, 3}
    assert gs.stats()[round_name(3)].replays > 0 and gs.stats()[round_name(0)].replays > 0
    policy = gen.adaptive  # the rounds it ran replaced the table's seconds with their own (and the host's gap)
    assert policy.cost[1, 3, False] < 1.0 and policy.cost[4, 0, False] < 1.0 and policy.host[1] > 0
    assert policy.cost[4, 3, False] == 9.0  # never ran: still the table's


def test_a_round_after_k_0_rounds_teaches_the_policy_nothing():
    """k = 0 rounds do not advance the draft, so the next drafting round proposes from a stale state: its
    rows are not observed; the round after it is (a scripted policy records what the decoder feeds it)."""
    from engine.speculative.adaptive_k import AdaptiveK

    class Scripted(AdaptiveK):
        def __init__(self, ks):
            super().__init__({1: {0: 1.0, 3: 1.0}}, 3)
            self.script, self.seen = list(ks), []

        def choose(self, b, mix=None):
            return self.script.pop(0)

        def observe(self, k, greedy, sampled):
            self.seen.append((k, len(greedy) + len(sampled)))

    target, plan, head, gs, k = setup("eagle3", sizes=(1,), batch=1)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    gen = spec_generator(target, plan, head, gs, k, 1, params)
    gen.adaptive = Scripted([3, 0, 0, 3, 3] + [3] * 12)
    prompt = random_prompts(1, seed=5)
    assert gen.generate(prompt, params)[0].tokens == Generator(target, 1).generate(prompt, params)[0].tokens
    assert gen.adaptive.seen[:5] == [(3, 1), (0, 1), (0, 0), (3, 0), (3, 1)]


def test_a_k_0_round_runs_no_draft_and_captures_no_aux():
    """A draft decoder's k = 0 round is the plain decode step: no draft forward and no aux hidden states in
    the target's verify (forward hooks on the real EAGLE3 head and target, inside rounds only), while a
    drafting round of the same decoder runs both; the output is the target's."""
    from engine.speculative.adaptive_k import AdaptiveK

    target, plan, head, gs, k = setup("eagle3", sizes=(1,), batch=1)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    gen = spec_generator(target, plan, head, gs, k, 1, params)
    script = [0] * 6 + [3] * 9

    class Scripted(AdaptiveK):
        def choose(self, b, mix=None):
            return script.pop(0)

    gen.adaptive = Scripted({1: {0: 1.0, 3: 1.0}}, 3)
    running, calls = [None], []  # the index of the round running (None: between rounds); (round, what) per forward
    gen.phase_hook = lambda phase: running.__setitem__(0, gen.rounds if phase else None)
    hooks = [
        head.register_forward_hook(lambda m, i, o: calls.append((running[0], "draft"))),
        target.register_forward_hook(
            lambda m, i, o: calls.append((running[0], "plain" if o.aux_hidden_states is None else "aux"))
        ),
    ]
    prompt = random_prompts(1, seed=7)
    try:
        got = gen.generate(prompt, params)[0].tokens
    finally:
        for h in hooks:
            h.remove()
    assert got == Generator(target, 1).generate(prompt, params)[0].tokens
    assert [gen.ks_used[0], gen.ks_used[3]] == [6, 3]  # 1 + 6 + 3 x 4 >= 10 tokens: the k = 3 rounds ran too
    k_0 = [what for r, what in calls if r is not None and r < 6]
    drafting = {what for r, what in calls if r is not None and r >= 6}
    assert k_0 == ["plain"] * 6 and drafting == {"draft", "aux"}


def test_a_join_under_k_0_puts_the_draft_prefill_off_to_the_next_drafting_round():
    """A batch that starts while the policy runs k = 0 does not prefill the draft; a batch started after
    it on the same rows replaces it; the first drafting round prefills the draft for the latest one,
    inside that round, to the state an eager prefill gives (the two decoders' draft buffers are equal
    after the same rounds), and the output is the target's."""
    from engine.speculative.adaptive_k import AdaptiveK

    class Scripted(AdaptiveK):
        def __init__(self, ks):
            super().__init__({2: {0: 1.0, 3: 1.0}}, 3)
            self.script = ks

        def choose(self, b, mix=None):
            return self.script.pop(0)

    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = random_prompts(6, seed=8)
    gens, begins, put_off = [], [], []  # begins: (decoder, inside a round?) per draft prefill
    for index in range(2):
        target, plan, head, gs, k = setup("eagle3", sizes=(2,), batch=2)
        gen = spec_generator(target, plan, head, gs, k, 2, params)
        begin, round_ = gen._draft_begin, gen.round
        inside = [False]

        def counted(*a, i=index, begin=begin, inside=inside, **kw):
            begins.append((i, inside[0]))
            return begin(*a, **kw)

        def in_round(*a, round_=round_, inside=inside, **kw):
            inside[0] = True
            try:
                r = round_(*a, **kw)
                put_off.append(r.put_off_s)
                return r
            finally:
                inside[0] = False

        gen._draft_begin, gen.round = counted, in_round
        gens.append(gen)
    late, eager = gens
    late.adaptive = Scripted([0] * 20)
    late.generate(prompts[:2], params)  # k = 0 throughout: the draft state is never read
    assert begins == [(0, False)]  # the first batch's prefill ran at its start (no round had run yet)
    late.generate(prompts[2:4], params)  # put off, never run: superseded
    late.adaptive.script = [3] * 20
    got = late.generate(prompts[4:], params)  # put off, then run by the first round (k = 3)
    assert begins == [(0, False), (0, True)]
    assert late.clock.totals().get("join_draft", 0) > 0  # its time: a join's, not the round's or the host's
    assert sum(s > 0 for s in put_off) == 1  # the round that ran it hands its wall time to the join
    eager.adaptive = Scripted([3] * 20)
    want = eager.generate(prompts[4:], params)
    assert begins[-1] == (1, False) and "join_draft" not in eager.clock.totals()
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.tokens for r in got] == [r.tokens for r in Generator(target, 2).generate(prompts[4:], params)]
    for name in ("d_hidden", "d_next"):
        assert torch.equal(late.draft.buf[name], eager.draft.buf[name]), name


def test_a_row_that_does_not_speculate_emits_what_k_0_would():
    """Through the scheduler, with the oracle draft (it proposes the target's own greedy continuation, so
    a speculating row keeps every draft): the row whose request turned speculation off keeps none and
    its output is the no-draft output, in a greedy batch (the accept kernel where it runs) and beside a
    sampled row (the sampled round's accept)."""
    import threading

    from engine.drafts.lookup.drafts import OracleDraft
    from engine.serve.scheduler import GenerationRequest, Scheduler
    from engine.speculative.generate import SpecDecoder

    _, target = pair()
    prompts, n = random_prompts(2, seed=23), 10
    base = [
        Generator(target, 1).generate([p], SamplingParams(max_new_tokens=n + 6, ignore_eos=True))[0].tokens
        for p in prompts
    ]
    for temperature in (0.0, 1.0):
        draft = OracleDraft([b[1:] for b in base], [len(p) + 1 for p in prompts])  # references after the first token
        sched = Scheduler(SpecDecoder(target, 2, draft, 3), 2, 8)
        done = threading.Semaphore(0)
        sink = lambda ev, done=done: ev.finish_reason and done.release()  # noqa: E731
        off = GenerationRequest(prompts[0], n, sink, speculative=False)
        on = GenerationRequest(prompts[1], n, sink, temperature=temperature, seed=3)
        for r in (off, on):
            sched.submit(r)
        sched.start()
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
        sched.close()
        assert off.output == base[0][:n] and set(off.accepts) == {0} and off.draft_tokens == 0
        assert len(off.accepts) == n - 1  # one token a round, as without a draft
        if temperature == 0:
            assert on.output == base[1][:n] and on.accepts[0] == 3 and on.draft_tokens == 3 * len(on.accepts)
        assert sched.stats.draft_tokens == on.draft_tokens and sched.stats.accepted_tokens == sum(on.accepts)


def test_a_sampled_row_that_does_not_speculate_draws_from_p0():
    """verify with speculate False: nothing accepted and the bonus distributed as p_0 itself (the
    drafted token included, which a rejection's residual would exclude); speculating rows accept."""
    g = torch.Generator().manual_seed(4)
    n, vocab = 20000, 6
    logits = (torch.randn(1, 3, vocab, generator=g) * 1.5).expand(n, 3, vocab)
    draft = logits[:, :2].argmax(-1)  # the likeliest tokens: a speculating row accepts them often
    draws = Draws(torch.ones(n), torch.ones(n), torch.arange(n) + 5)  # temperature 1, top-p 1, a seed per row
    speculate = torch.arange(n) % 2 == 0
    a, bonus = verify(logits, draft, None, draws, torch.zeros(n, dtype=torch.long), speculate=speculate)
    assert (a[~speculate] == 0).all() and a[speculate].float().mean() > 0.3
    p0 = torch.softmax(logits[0, 0], -1)
    freq = torch.bincount(bonus[~speculate], minlength=vocab).float() / (n // 2)
    assert (freq - p0).abs().max() < 0.02, (freq, p0)


def test_a_server_round_spans_the_slots_up_to_the_last_occupied_one():
    """One request in slot 0 of 4: its rounds run over one row (the bucket of 1 replays), whatever the
    other slots hold."""
    import threading

    from engine.serve.scheduler import GenerationRequest, Scheduler
    from engine.speculative.generate import SpecDecoder

    target, plan, head, gs, k = setup("eagle3", sizes=(1, 4), batch=4)
    draft = make_draft(plan, head, target, 4, k, graphs=gs)
    sched = Scheduler(SpecDecoder(target, 4, draft, k, graphs=gs), 4, 8)
    done = threading.Event()
    req = GenerationRequest(random_prompts(1, seed=17)[0], 9, lambda ev: ev.finish_reason and done.set())
    sched.submit(req)
    sched.start()
    assert done.wait(timeout=60)
    sched.close()
    want = build(target, "eagle3", 1, SamplingParams()).generate(
        [req.prompt], SamplingParams(max_new_tokens=9, ignore_eos=True)
    )
    assert req.output == want[0].tokens
    runner = gs.get(round_name(k))
    assert runner.stats.replays == sched.stats.rounds > 0 and sched.stats.rounds_by_k == {k: sched.stats.rounds}


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_rows_logits_do_not_depend_on_the_batch_around_it():
    """bf16, the fused path: row 0's logits are bitwise the same in a decode step alone (1 token), in a
    verify of 6 tokens, and beside 31 other rows (decode and verify): no kernel of decode or verify
    picks its configuration by row count, no split depends on the batch."""
    _, target = pair()
    target = target.to("cuda", torch.bfloat16)
    target.init_buffers(torch.device("cuda"))
    target.attention_kernel = True
    target.use_fused_kernels()
    g = torch.Generator().manual_seed(0)
    prompt, cont = torch.randint(0, 256, (12,), generator=g), torch.randint(0, 256, (6,), generator=g)

    def first_logits(batch: int, t: int) -> torch.Tensor:
        ids = torch.randint(0, 256, (batch, 12 + t), generator=g)
        ids[0, :12], ids[0, 12:] = prompt, cont[:t]
        ids = ids.cuda()
        cache = target.new_cache(batch)
        with torch.inference_mode():
            target(ids[:, :12], torch.arange(12, device="cuda").expand(batch, 12), cache, kv_len=12)
            pos = torch.arange(12, 12 + t, device="cuda").expand(batch, t)
            return target(ids[:, 12:], pos, cache, kv_len=12 + t).logits[0, 0]  # [vocab]

    alone = first_logits(1, 1)
    for batch, t in ((1, 6), (32, 1), (32, 6), (7, 3)):
        assert torch.equal(first_logits(batch, t), alone), (batch, t)
