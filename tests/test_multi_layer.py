"""Multi-layer EAGLE (MTP-style). Lossless greedy at batch 1 and 4 under none and debug (full,
breakable and bcg in tests/test_graphs.py on a GPU); proposals equal the teacher-forced training
forward after every partial acceptance; hazard 6 (each module its own KV pool, in prefill and in
decode, eager and through the round's runner); the seed-002 fallback (batch above the largest capture
size, NaN-poisoned graph tensors: output equals eager); the plan's checks; a test-sized train_draft run."""

from __future__ import annotations

import pytest
import torch
from helpers.models import pair, random_prompts
from helpers.runs import compose_cfg
from helpers.spec import (
    CUDA,
    POLICIES,
    mtp_training_proposal,
    oracle_prefix,
    poison,
    run_all,
    setup,
    spec_generator,
    tap,
)
from helpers.train import assert_trained_beats_random, tiny_train

from engine.drafts.multi_layer import StepCaches
from engine.drafts.registry import draft_config, load_head, make_draft, plan_draft
from engine.errors import ConfigError
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator
from engine.speculative.graph_set import GraphSet, round_name

K = 3


@pytest.fixture(scope="module")
def target():
    return pair()[1]


def _head(target, k=K, seed=0):
    plan = plan_draft(draft_config("multi_layer_eagle", init="random", num_steps=k), target.args)
    head = load_head(plan, target, seed, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # spread weights: varied proposals, so a mixed-up pool changes them
        g = torch.Generator().manual_seed(seed)
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return plan, head


def _generator(target, plan, head, batch, params, k=K):
    draft = make_draft(plan, head, target, batch, k, cfg=draft_config("multi_layer_eagle", num_steps=k))
    return Generator(target, batch, draft, k)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_is_lossless(target, batch):
    prompts = random_prompts(4, seed=3)
    params = SamplingParams(max_new_tokens=29, ignore_eos=True)
    base = [r.tokens for r in run_all(Generator(target, batch), prompts, params, batch)]
    plan, head = _head(target)
    assert [r.tokens for r in run_all(_generator(target, plan, head, batch, params), prompts, params, batch)] == base


def _partial_run(target, head, plan, prompts, caches=None, graphs: bool = False):
    """Real MTP proposals, each row's checked against the training forward, then replaced by the target's
    own tokens up to a random depth per row (partial, per-row acceptance). graphs: through the round's
    runner (debug backend) instead of the eager round."""
    params = SamplingParams(max_new_tokens=21, ignore_eos=True)
    b = len(prompts)
    base = [r.tokens for r in Generator(target, b).generate(prompts, params)]
    draft = make_draft(plan, head, target, b, K, cfg=draft_config("multi_layer_eagle", num_steps=K))
    if caches is not None:
        draft.caches = caches
    checked, g = [], torch.Generator().manual_seed(0)

    def check_then_replace(s, k, logits):
        state, tokens = s.state.value, s.draft[:, :k]
        live = [i for i in range(len(state.live)) if state.live[i]]
        for i in live:
            drafts = tokens[i].tolist()
            assert drafts == mtp_training_proposal(target, head, state.history[i] + drafts[:-1], k)
            checked.append(i)
        s.draft[:, :k] = oracle_prefix(tokens, state, base, [len(p) for p in prompts], g, k, live)

    tap(draft, "propose", check_then_replace)
    gs = None
    if graphs:
        gs = GraphSet(target, draft, b, K, "debug", "debug", [b], [16], features=True).capture()
    gen = Generator(target, b, draft, K, graphs=gs)
    res = gen.generate(prompts, params)
    if gs is not None:
        assert gs.stats()[round_name(K)].replays > 0
    return res, base, checked


@pytest.mark.parametrize("graphs", [False, True])
def test_proposals_equal_the_training_forward_after_partial_acceptance(target, graphs):
    """After prefill and after every commit of a partial acceptance (different per row), each proposal
    equals the teacher-forced forward over the accepted history plus the drafts: no stale slot, no
    hidden state from the wrong position, and inference matches what training optimises. Eagerly and
    through the round's graph runner."""
    prompts = random_prompts(3, seed=12)
    plan, head = _head(target)
    res, base, checked = _partial_run(target, head, plan, prompts, graphs=graphs)
    assert [r.tokens for r in res] == base
    accepts = {a for r in res for a in r.accepts}
    assert len(checked) >= 12 and len(accepts) >= 3  # partial acceptances of several depths checked


@pytest.mark.parametrize("graphs", [False, True])
def test_hazard_6_modules_sharing_one_pool_are_caught(target, graphs):
    """The seed-003 bug (every step reading and writing the first runner's pool) breaks the check above."""
    prompts = random_prompts(2, seed=12)
    plan, head = _head(target)
    shared = head.new_cache(len(prompts))
    with pytest.raises(AssertionError):
        _partial_run(target, head, plan, prompts, caches=StepCaches([shared[0]] * K), graphs=graphs)


def _changed(before: list[torch.Tensor], caches: StepCaches) -> list[int]:
    return [i for i, (b, c) in enumerate(zip(before, caches.caches)) if not torch.equal(b, c.k)]


def test_hazard_6_each_module_writes_only_its_own_pool_in_prefill_and_decode(target):
    """Snapshot every module's KV pool, run one module's forward of each kind (prefill over the prompt,
    a proposal window, a commit over k+1 positions): only that module's pool changed."""
    plan, head = _head(target)
    caches = head.new_cache(2)
    g = torch.Generator().manual_seed(0)
    h = head.args.hidden_size
    shapes = {"prefill": (2, 9, 0), "window": (2, 2, 7), "commit": (2, K + 1, 8)}
    for kind, (b, t, start) in shapes.items():
        for i in range(K):
            before = [c.k.clone() for c in caches.caches]
            tokens = torch.randint(0, 256, (b, t), generator=g)
            hidden = torch.randn(b, t, h, generator=g)
            a = head.attn_inputs(
                torch.arange(start, start + t).expand(b, t), torch.ones(b, t, dtype=torch.bool), start + t
            )
            head.module_forward(i, tokens, hidden, caches.rows(b)[i], a)
            assert _changed(before, caches) == [i], (kind, i)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("policy", POLICIES + (["bcg"] if CUDA else []))
def test_graph_policies_are_lossless_and_count_replays(policy, batch):
    """debug on CPU; full, breakable and bcg (target full, draft breakable) with real capture on a GPU."""
    device = "cuda" if policy != "debug" else "cpu"
    kw = dict(policy="full", draft_policy="breakable") if policy == "bcg" else dict(policy=policy)
    target, plan, head, gs, k = setup("multi_layer_eagle", sizes=(1, 2, 4), batch=4, device=device, **kw)
    prompts = random_prompts(4, seed=5)
    params = SamplingParams(max_new_tokens=17, ignore_eos=True)
    base = [r.tokens for r in run_all(Generator(target, batch), prompts, params, batch)]
    gen = spec_generator(target, plan, head, gs, k, batch, params)
    assert [r.tokens for r in run_all(gen, prompts, params, batch)] == base
    stats = gs.stats()[round_name(k)]
    assert stats.replays > 0 and stats.fallbacks == 0


def test_fallback_above_capture_size_reads_eager_outputs_not_poisoned_buffers():
    """Seed 002: when a module's graph cannot run (4 rows > largest capture size 2), every consumer,
    the hidden-state pool update included, takes the eager outputs: NaN in every static tensor the
    graphs own changes nothing."""
    target, plan, head, gs, k = setup("multi_layer_eagle", sizes=(1, 2), batch=4)
    for runner in gs.runners.values():
        poison(runner)
    prompts = random_prompts(4, seed=8)
    params = SamplingParams(max_new_tokens=17, ignore_eos=True)
    base = [r.tokens for r in Generator(target, 4).generate(prompts, params)]
    gen = spec_generator(target, plan, head, gs, k, 4, params)
    assert [r.tokens for r in gen.generate(prompts, params)] == base
    assert torch.isfinite(gen.draft.pool).all()
    stats = gs.stats()[round_name(k)]
    assert stats.fallbacks > 0 and stats.replays == 0


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(init="checkpoint", path=None), "draft.path"),
    ],
)
def test_plan_errors(target, overrides, key):
    with pytest.raises(ConfigError) as e:
        plan_draft(draft_config("multi_layer_eagle", **{"init": "random", **overrides}), target.args)
    assert e.value.key == key
    with pytest.raises(TypeError, match="aux_layer_ids"):  # not a key of its schema (Hydra: no such key)
        draft_config("multi_layer_eagle", init="random", aux_layer_ids=[1, 2])


def test_checkpoint_round_trip_and_module_count_check(target, tmp_path):
    plan, head = _head(target, k=2)
    head.save(tmp_path / "mtp")
    loaded_plan = plan_draft(
        draft_config("multi_layer_eagle", init="checkpoint", path=str(tmp_path / "mtp"), num_steps=2),
        target.args,
    )
    loaded = load_head(loaded_plan, target, 1, torch.device("cpu"), torch.float32)
    for (n, a), (m, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a, b)
    assert loaded.lm_head is target.lm_head and loaded.embed is target.model.embed_tokens
    with pytest.raises(ConfigError, match="num_steps"):
        plan_draft(
            draft_config("multi_layer_eagle", init="checkpoint", path=str(tmp_path / "mtp"), num_steps=3),
            target.args,
        )


TRAIN = tiny_train("train_mtp_smollm2")


def test_train_draft_stage_trains_an_mtp_head_that_beats_a_random_one(outputs, tmp_path):
    import json

    from pipeline.__main__ import run

    ctx = run(compose_cfg(*TRAIN))
    head_dir = outputs / "train" / "train_mtp_smollm2" / "head"
    assert ctx["draft_checkpoint"] == str(head_dir)
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMMultiLayerEagle"] and cfg["num_nextn_predict_layers"] == 3
    assert "multi_layer_eagle" in (head_dir / "README.md").read_text()
    common = [
        "+experiment=mtp",
        "model=tiny",
        "model.random.init_std=0.15",
        "eval.max_new_tokens=24",
        "eval.batch_size=4",
        "draft.num_steps=3",
    ]
    assert_trained_beats_random(
        outputs, tmp_path, common, ["draft.init=checkpoint", f"draft.path={head_dir}"], ["draft.init=random"]
    )
