"""DFlash: lossless greedy under every policy, rejection sampling in distribution, the draft state
after partial acceptance, row-slice prefill, the NaN-poisoned fallback, the plan's checks, the
checkpoint format, the training forward against inference, and a test-sized `train_draft` run whose
head beats a random one."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
from helpers.models import pair, qwen3_pair, random_prompts, spread_init
from helpers.runs import compose_cfg
from helpers.spec import AUX, oracle_prefix, poison, tap
from helpers.train import DFLASH_TRAIN, assert_trained_beats_random, assert_triton_ops_match_torch_ops
from safetensors import safe_open
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from engine.drafts.base import SpecState
from engine.drafts.common.ttt import TRITON_OPS
from engine.drafts.dflash import DFlashDraft
from engine.drafts.dflash.plan import describe_dflash
from engine.drafts.dflash.train import AnchorPack, dflash_forward, dflash_forward_packed
from engine.drafts.registry import draft_config, load_head, make_draft, plan_draft
from engine.drafts.train_contract import Batch, step_valid, ttt_loss
from engine.errors import ConfigError
from engine.ops import AttnInputs
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator
from engine.speculative.graph_set import GraphSet, round_name
from pipeline.__main__ import run
from pipeline.config import to_run_config
from pipeline.plan import PlanError, build_plan

CUDA = torch.cuda.is_available()
KERNELS = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
K, BLOCK = 3, 4
TINY = ["model=tiny", "draft.init=random", "draft.aux_layer_ids=[1,2,3]", "draft.aux_layer_convention=input_of"]


@pytest.fixture(scope="module")
def target():
    return pair()[1]


def dflash_cfg(**kw):
    base = dict(init="random", num_steps=K, aux_layer_ids=AUX, block_size=BLOCK, num_layers=2)
    return draft_config("dflash", **{**base, **kw})


def make_head(target, device="cpu", std=0.1, seed=0, **kw):
    """A random head with weights wide enough that its logits depend on the context."""
    plan = plan_draft(dflash_cfg(**kw), target.args)
    target.set_aux_layers(plan.aux.input_of)
    head = load_head(plan, target, 0, torch.device(device), torch.float32)
    with torch.no_grad():
        spread_init(head, seed=seed, std=std)
    return plan, head


def generator(target, plan, head, batch, params, graphs=None):
    draft = make_draft(plan, head, target, batch, K, graphs=graphs)
    return Generator(target, batch, draft, K, graphs=graphs)


class Recorder:
    """Taps a DFlashDraft's proposal (attach before a GraphSet captures it): records every block's logits,
    and (with references) replaces the proposed tokens by the target's own up to a random depth per row,
    so acceptance is partial and uneven."""

    def __init__(self, draft: DFlashDraft, references=None, prompt_lens=None, seed=0):
        self.logits = []
        g = torch.Generator().manual_seed(seed)

        def record(s, k, logits):
            self.logits.append(logits.clone())
            if references is not None:
                s.draft[:, :k] = oracle_prefix(s.draft[:, :k], s.state.value, references, prompt_lens, g, k)

        tap(draft, "propose", record)


def run_batches(gen, prompts, params, batch):
    out = []
    for i in range(0, len(prompts), batch):
        out += gen.generate(prompts[i : i + batch], params, row_ids=list(range(i, min(i + batch, len(prompts)))))
    return out


# ------------------------------------------------------------------------------------------ lossless


def _lossless(policy, batch, kernel=False, kv_heads=None, window=None):
    device = "cuda" if policy in ("full", "breakable") else "cpu"
    _, target = pair()
    target = target.to(device)
    target.init_buffers(torch.device(device))
    target.attention_kernel = kernel  # the head follows in bind(): Triton decode attention, else SDPA
    plan, head = make_head(target, device, num_kv_heads=kv_heads, sliding_window=window)
    prompts = random_prompts(4)
    params = SamplingParams(max_new_tokens=29, ignore_eos=True)
    base = [r.tokens for r in run_batches(Generator(target, batch), prompts, params, batch)]
    draft = make_draft(plan, head, target, batch, K)
    rec = Recorder(draft, base, [len(p) for p in prompts])
    graphs = None
    if policy != "none":
        graphs = GraphSet(
            target, draft, batch, K, policy, policy, [s for s in (1, 2, 4) if s <= batch], [16], features=True
        ).capture()
    gen = Generator(target, batch, draft, K, graphs=graphs)
    res = run_batches(gen, prompts, params, batch)
    assert [r.tokens for r in res] == base
    accepts = [a for r in res for a in r.accepts]
    assert len(set(accepts)) >= 3  # partial acceptance of several depths: commits of several widths
    if graphs is not None:
        stats = graphs.stats()[round_name(K)]
        assert stats.replays > 0 and stats.fallbacks == 0
    return rec.logits, target, plan, head, prompts, params, base


@pytest.mark.parametrize("kv_heads, window", [(None, None), (4, None), (None, 6)])  # 6: a context window
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("policy", ["none", "debug"])
def test_greedy_is_lossless(policy, batch, kv_heads, window):
    _lossless(policy, batch, kv_heads=kv_heads, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads, window", [(None, None), (4, None), (None, 6)])
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("policy", ["full", "breakable"])
def test_greedy_is_lossless_under_cuda_graphs(policy, batch, attention, kv_heads, window):
    """The graphs' proposals equal eager ones along the same trajectory (same partial-oracle draws)."""
    got, target, plan, head, prompts, params, base = _lossless(policy, batch, attention == "triton", kv_heads, window)
    gen = generator(target, plan, head, batch, params)
    rec = Recorder(gen.draft, base, [len(p) for p in prompts])
    run_batches(gen, prompts, params, batch)
    assert len(got) == len(rec.logits)
    for a, b in zip(got, rec.logits):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_debug_graphs_propose_what_eager_proposes():
    got, target, plan, head, prompts, params, base = _lossless("debug", 2)
    gen = generator(target, plan, head, 2, params)
    rec = Recorder(gen.draft, base, [len(p) for p in prompts])
    run_batches(gen, prompts, params, 2)
    assert len(got) == len(rec.logits) > 10
    for a, b in zip(got, rec.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ state
def test_state_after_partial_acceptance_equals_fresh_prefill(target):
    """After every commit, the next block equals the block of a draft freshly prefilled over the same
    history: the commit writes the verified positions at the right slots, the bonus is the right token,
    and neither rejected drafts nor the previous block's slots leak into the next block."""
    plan, head = make_head(target)
    prompts = random_prompts(3, seed=12)
    params = SamplingParams(max_new_tokens=25, ignore_eos=True)
    base = [r.tokens for r in Generator(target, 3).generate(prompts, params)]
    gen = generator(target, plan, head, 3, params)
    draft = gen.draft
    Recorder(draft, base, [len(p) for p in prompts])
    fresh = DFlashDraft(head, 1, K)
    checked = []

    def check(s, k, v):
        state, emitted, accepted = s.state.value, v.emitted, v.accepted
        hists = [h + emitted[i, : int(accepted[i]) + 1].tolist() for i, h in enumerate(state.history)]
        after = SpecState(hists, [len(h) - 1 for h in hists], list(state.live), state.row_ids, "cpu")
        nxt = DFlashDraft.propose(draft, after, K)  # the block the next round will run (writes only block slots)
        for i in range(len(prompts)):
            if not state.live[i]:
                continue
            ids = torch.tensor([hists[i][:-1]])  # in the target cache; hists[i][-1]: the pending bonus token
            out = target(ids, torch.arange(ids.shape[1])[None], target.new_cache(1), kv_len=ids.shape[1])
            fresh.begin(
                None,
                out.aux_hidden_states,
                ids,
                torch.ones_like(ids, dtype=torch.bool),
                None,
                torch.tensor([hists[i][-1]]),
            )
            one = SpecState([hists[i]], [ids.shape[1]], [True], [0], "cpu")
            torch.testing.assert_close(draft_logits(draft, after)[i], draft_logits(fresh, one)[0], atol=1e-4, rtol=1e-4)
            assert torch.equal(nxt.tokens[i], fresh.propose(one, K).tokens[0])
            checked.append(int(accepted[i]))

    tap(draft, "commit", check)
    res = gen.generate(prompts, params)
    assert [r.tokens for r in res] == base
    assert len(set(checked)) >= 3  # states checked after partial acceptances of several depths


def write_context(head, cache, feats, positions, valid) -> None:
    """The drafter's context write (its k/v of feats [b, t, F] at positions [b, t]) into `cache`."""
    a = AttnInputs.build(positions, valid, head.rope_cos, head.rope_sin, cache.dummy_slot, feats.dtype)
    head.write_context(feats, cache, a)


def draft_logits(draft, state, last_token=None):
    """The running draft's next block logits [b, k, vocab], eagerly over its cache: the block starts with
    each row's last emitted token (with `last_token`: the block's last mask replaced by that token)."""
    dev = draft.head.fc.weight.device
    lengths = torch.tensor(state.lengths, device=dev)
    b = len(state.lengths)
    tokens = torch.full((b, BLOCK), draft.head.mask_token_id, device=dev)
    tokens[:, 0] = torch.tensor([h[-1] for h in state.history], device=dev)
    if last_token is not None:
        tokens[:, -1] = last_token
    positions = lengths[:, None] + torch.arange(BLOCK, device=dev)
    valid = torch.ones(b, BLOCK, dtype=torch.bool, device=dev)
    a = draft.head.block_inputs(positions, valid, max(state.lengths) + BLOCK, draft.head.embed.weight.dtype)
    return draft.head(tokens, draft.cache.rows(b), a, K, False).logits


def _prefill(target, prompts):
    dev = target.lm_head.weight.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    ids, lens = ids.to(dev), torch.tensor([len(p) for p in prompts], device=dev)
    positions = torch.arange(width, device=dev).expand(len(prompts), width)
    valid = positions < lens[:, None]
    out = target(ids, positions, target.new_cache(len(prompts)), valid=valid, kv_len=width)
    return out.aux_hidden_states, ids, valid, out.logits[torch.arange(len(prompts)), lens - 1].argmax(-1)


def test_begin_on_row_slices_equals_whole_batch(target):
    plan, head = make_head(target)
    prompts = random_prompts(3, seed=21)
    whole, parts = DFlashDraft(head, 3, K), DFlashDraft(head, 3, K)
    whole.begin(None, *_prefill(target, prompts)[:3], None, _prefill(target, prompts)[3])
    for sl in (slice(0, 2), slice(2, 3)):
        feats, ids, valid, first = _prefill(target, prompts[sl])
        parts.begin(None, feats, ids, valid, None, first, rows=sl)
    firsts = _prefill(target, prompts)[3].tolist()
    state = SpecState(
        [list(p) + [f] for p, f in zip(prompts, firsts)], [len(p) for p in prompts], [True] * 3, [0, 1, 2], "cpu"
    )
    torch.testing.assert_close(draft_logits(whole, state), draft_logits(parts, state), atol=1e-5, rtol=1e-5)
    assert torch.equal(whole.propose(state, K).tokens, parts.propose(state, K).tokens)


# ------------------------------------------------------------------------------------------ fallback
@pytest.mark.parametrize("policy", ["debug"] + (["full", "breakable"] if CUDA else []))
def test_fallback_with_poisoned_buffers_equals_eager(policy):
    """Batches above the largest capture size run eagerly; the graphs' static tensors, poisoned with
    NaN, must not reach the proposals (DESIGN.md hazard 2, for both draft phases)."""
    device = "cuda" if policy != "debug" else "cpu"
    _, target = pair()
    target = target.to(device)
    target.init_buffers(torch.device(device))
    plan, head = make_head(target, device)
    prompts = random_prompts(4, seed=31)
    params = SamplingParams(max_new_tokens=13, ignore_eos=True)
    base = [r.tokens for r in Generator(target, 4).generate(prompts, params)]
    draft = make_draft(plan, head, target, 4, K)
    got = Recorder(draft, base, [len(p) for p in prompts])
    gs = GraphSet(target, draft, 4, K, policy, policy, [1, 2], [16], features=True).capture()
    poison(gs.get(round_name(K)))
    eager = generator(target, plan, head, 4, params)
    want = Recorder(eager.draft, base, [len(p) for p in prompts])
    eager.generate(prompts, params, row_ids=[0, 1, 2, 3])
    gen = Generator(target, 4, draft, K, graphs=gs)
    assert [r.tokens for r in gen.generate(prompts, params, row_ids=[0, 1, 2, 3])] == base  # 4 rows > 2
    stats = gs.stats()[round_name(K)]
    assert stats.replays == 0 and stats.fallbacks == len(got.logits) > 0
    for a, b in zip(got.logits, want.logits):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------ plan
def test_plan_rejects_dflash_without_explicit_layer_ids(target, outputs):
    with pytest.raises(ConfigError, match=r"draft.aux_layer_ids=None.*no default target layers") as e:
        plan_draft(dflash_cfg(aux_layer_ids=None), target.args)
    assert "e.g. [" in str(e.value)
    with pytest.raises(PlanError, match=r"draft.aux_layer_ids=None"):
        build_plan(
            to_run_config(compose_cfg(*TINY, "+experiment=dflash", "draft.aux_layer_ids=null", "device=cpu")), outputs
        )


@pytest.mark.parametrize(
    "override, key",
    [
        (dict(num_steps=4), "draft.num_steps"),  # k = 4 > block 4 - 1
        (dict(block_size=1, num_steps=1), "draft.block_size"),
        (dict(mask_token_id=320), "draft.mask_token_id"),  # the tiny vocabulary has 320 ids
        (dict(num_layers=0), "draft.num_layers"),
        (dict(intermediate_size=0), "draft.intermediate_size"),
        (dict(num_kv_heads=3), "draft.num_kv_heads"),  # the tiny target's 4 query heads do not group by 3
        (dict(aux_layer_ids=[1, 9]), "draft.aux_layer_ids"),
        (dict(sliding_window=4), "draft.sliding_window"),  # must reach past the block of 4
        (dict(sliding_window=-1), "draft.sliding_window"),
    ],
)
def test_plan_names_the_bad_key(target, override, key):
    with pytest.raises(ConfigError) as e:
        plan_draft(dflash_cfg(**override), target.args)
    assert e.value.key == key


def test_aux_capture_is_configured_before_graph_capture(outputs):
    plan = build_plan(
        to_run_config(compose_cfg(*TINY, "+experiment=dflash", "graph=debug", "device=cpu", "draft.num_layers=2")),
        outputs,
    )
    assert plan.names == ["load", "configure_aux_capture", "capture_graphs", "eval"]
    assert "output_of [0, 1, 2] (from config)" in plan.describe()
    assert "block 8 (mask token 319), 2 layers" in plan.describe()


# ------------------------------------------------------------------------------------------ checkpoint
def test_checkpoint_round_trip(target, tmp_path):
    plan, head = make_head(target, seed=3)
    head.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == BLOCK
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2] and cfg["num_hidden_layers"] == 2
    assert cfg["mask_token_id"] == 319 and cfg["target_hidden_size"] == 64
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_proj.weight"} <= names
    assert not any(n.startswith(("embed", "lm_head")) for n in names)  # the target's, not stored

    # Loads with the checkpoint's ids (none configured), and drafts exactly as the saved head.
    loaded_plan = plan_draft(
        dflash_cfg(init="checkpoint", path=str(tmp_path), aux_layer_ids=None, block_size=None, num_layers=None),
        target.args,
    )
    assert loaded_plan.aux.input_of == (1, 2, 3) and loaded_plan.aux.source == "checkpoint"
    loaded = load_head(loaded_plan, target, 0, torch.device("cpu"), torch.float32)
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # fc width against the configured ids, before any weight is read
    with pytest.raises(ConfigError, match="fc.weight takes 192 inputs, but the target provides 128"):
        plan_draft(dflash_cfg(init="checkpoint", path=str(tmp_path), aux_layer_ids=[1, 2]), target.args)
    with pytest.raises(ConfigError, match="mask_token_id=319"):
        plan_draft(dflash_cfg(init="checkpoint", path=str(tmp_path), mask_token_id=5), target.args)


def test_context_window_is_a_checkpoint_setting(target, tmp_path):
    """draft.sliding_window: written as Hugging Face's non-causal `sliding_attention` layers (z-lab's
    reference reads them), read back from a checkpoint, overridden by the config (0: the whole context);
    a checkpoint whose layers mix attention types is one clear error."""
    plan, head = make_head(target, sliding_window=6)
    assert "context window 6" in " ".join(describe_dflash(plan))
    head.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 6
    assert cfg["is_causal"] is False
    ckpt = dict(init="checkpoint", path=str(tmp_path), aux_layer_ids=None, block_size=None, num_layers=None)
    for window, want in ((None, 6), (0, 0), (9, 9)):
        p = plan_draft(dflash_cfg(**ckpt, sliding_window=window), target.args)
        assert load_head(p, target, 0, torch.device("cpu"), torch.float32).sliding_window == want
        assert ("layer_types" in p.head_config) == bool(want)
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="layer_types") as e:
        plan_draft(dflash_cfg(**ckpt), target.args)
    assert e.value.key == "draft.path"


# ------------------------------------------------------------------------------------------ training
def _random_batch(head, b: int, t: int, device="cpu", seed: int = 0) -> Batch:
    """Random features and tokens at positions 0..T-1, every position trained (no labels)."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, t, head.feature_width, generator=g).to(device)  # [b, t, F]
    tokens = torch.randint(0, 320, (b, t), generator=g).to(device)  # [b, t]
    positions = torch.arange(t, device=device).expand(b, t)
    return Batch(tokens, positions, feats, None, None, torch.ones(b, t, dtype=torch.bool, device=device))


@pytest.mark.parametrize(
    "arch, kv_heads, window", [("llama", None, None), ("llama", 4, None), ("llama", None, 6), ("qwen3", None, None)]
)  # the target's 2 key/value heads, one per query head, a context window of 6 positions; a Qwen3 target
def test_training_forward_equals_the_inference_block(target, arch, kv_heads, window):
    """dflash_forward's step s at position p is the block anchored at j = p - s, computed through the
    draft's own programs: context written for 0..j, block [x_{j+1}, m, ...] at j+1..j+B (with a window,
    each block query reads the context within it there as in training). A Qwen3 target's drafter has
    Qwen3 layers: its q/k norms (spread) in both."""
    target = qwen3_pair()[1] if arch == "qwen3" else target
    plan, head = make_head(target, seed=5, num_kv_heads=kv_heads, sliding_window=window)
    if arch == "qwen3":
        assert plan.head_config["model_type"] == "qwen3" and head.args.qk_norm
        spread_init(head, seed=5, std=0.1, norms=0.3)
    assert head.sliding_window == (window or 0)
    b, t = 2, 12
    batch = _random_batch(head, b, t)
    feats, tokens, positions = batch.feats, batch.tokens, batch.positions
    with torch.no_grad():
        logits = dflash_forward(head, batch, BLOCK - 1)
    for row in range(b):
        for j in (0, 4, t - 1):
            cache = head.new_cache(1)
            write_context(head, cache, feats[row : row + 1, : j + 1], positions[:1, : j + 1], None)
            block_tokens = torch.tensor([[int(tokens[row, j])] + [head.mask_token_id] * (BLOCK - 1)])
            a = head.block_inputs(j + 1 + torch.arange(BLOCK)[None], None, j + 1 + BLOCK, torch.float32)
            block = head(block_tokens, cache, a, BLOCK - 1, False).logits[0]  # [B-1, vocab]
            for s in range(BLOCK - 1):
                if j + s < t:
                    torch.testing.assert_close(logits[s][row, j + s], block[s], atol=2e-5, rtol=1e-4)
    if window:  # the window bites: the last anchor's drafts differ from those that read the whole context
        head.sliding_window = 0
        with torch.no_grad():
            whole = dflash_forward(head, batch, BLOCK - 1)
        assert (whole[0][:, t - 1] - logits[0][:, t - 1]).abs().max() > 1e-3
        torch.testing.assert_close(whole[0][:, 0], logits[0][:, 0])  # the first anchor reads position 0 only


def _spanned_batch(head, spans, t: int, device="cpu") -> Batch:
    """`_random_batch` whose rows train [first, end) only (spans [B, 2]), with random label logits."""
    batch = _random_batch(head, len(spans), t, device)
    p = torch.arange(t)
    batch.mask = ((p >= spans[:, :1]) & (p < spans[:, 1:])).to(device)
    batch.spans = spans
    g = torch.Generator().manual_seed(1)
    batch.label_logits = torch.randn(len(spans), t, 320, generator=g).to(device)
    batch.top = batch.label_logits.argmax(-1)
    return batch


# rows training a middle span, every position, nothing (a prompt cut at max_len), and the last few
SPANS = torch.tensor([[5, 30], [0, 37], [20, 20], [33, 36]])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("window", [None, 6])
def test_packed_training_forward_equals_the_dense_one_at_every_trained_position(target, window):
    """train.attention=flex runs `dflash_forward_packed`: the trained anchors' blocks only, packed into one
    FlexAttention sequence. Each step's Rows are exactly that step's valid positions, each once, with the
    dense forward's logits there, and the loss and accuracy figures are the dense forward's. CPU runs
    FlexAttention's reference forward; the GPU test below covers its kernel and the backward."""
    _, head = make_head(target, seed=3, sliding_window=window)
    batch = _spanned_batch(head, SPANS, 37)  # T not a multiple of any tile
    with torch.no_grad():
        dense = dflash_forward(head, batch, BLOCK - 1)
        packed = dflash_forward_packed(head, batch, BLOCK - 1)
    assert len(packed) == BLOCK - 1
    for s, (d, r) in enumerate(zip(dense, packed)):
        assert torch.equal(r.position.sort().values, step_valid(batch.mask, s).flatten().nonzero().flatten())
        torch.testing.assert_close(r.logits, d.flatten(0, 1)[r.position], atol=1e-5, rtol=1e-5)
    (l0, st0), (l1, st1) = ttt_loss(dense, batch, 0.75), ttt_loss(packed, batch, 0.75)
    torch.testing.assert_close(l1, l0)
    assert st0.keys() == st1.keys() and all(torch.allclose(st1[k], st0[k]) for k in st0)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "blk, window, t", [(8, 0, 300), (8, 256, 300), (8, 256, 700), (4, 6, 200), (6, 0, 97)]
)  # the recipe's block and window, over short rows and rows past the window; a block that does not divide a tile
def test_anchor_pack_plans_every_key_tile_its_queries_read(blk, window, t):
    """The pack's block mask is planned from the spans, never evaluated over [Q, KV]: its key tiles must
    cover every tile where the mask admits a key (FlexAttention's kernel skips the others), checked against
    the mask evaluated everywhere; and the planned tiles stay near that minimum. A tile planned full (its
    mask not evaluated by the kernel) must be visible at every query and key."""
    g = torch.Generator().manual_seed(blk + t)
    rows = 7 if t < 500 else 3  # long rows: fewer, so that the mask evaluated everywhere stays small
    first = torch.randint(0, t // 2, (rows,), generator=g)
    end = torch.minimum(first + torch.randint(t // 4, t, (rows,), generator=g), torch.tensor(t))
    end[-1] = first[-1]  # a row that trains nothing
    pack = AnchorPack.plan(torch.stack([first, end], 1), t, blk - 1, blk, window, "cpu")
    q, kv = pack.mask.seq_lengths
    needed = create_block_mask(pack.mask.mask_mod, None, None, q, kv, device="cpu").to_dense()[0, 0].bool()
    planned = pack.mask.to_dense()[0, 0].bool()
    assert needed.shape == planned.shape and needed.sum() > needed.shape[0]
    assert not (needed & ~planned).any()
    assert planned.sum() <= 1.1 * needed.sum()
    m = pack.mask
    full = torch.zeros_like(planned)
    for r in range(full.shape[0]):
        full[r, m.full_kv_indices[0, 0, r, : m.full_kv_num_blocks[0, 0, r]].long()] = True
    if window >= 2 * 128 and t > 2 * window:  # anchors past a window of whole tiles: most query tiles read one whole
        assert full.sum() > full.shape[0] // 2
    visible = create_mask(m.mask_mod, None, None, q, kv, device="cpu")[0, 0]  # [Q, KV]
    tile = m.BLOCK_SIZE[0]
    for r, c in full.nonzero().tolist():
        assert visible[r * tile : (r + 1) * tile, c * tile : (c + 1) * tile].all()
    # the key tiles' tables (the backward's), planned on the host: torch's own transpose of the query tiles'
    ref = BlockMask.from_kv_blocks(
        m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices, tile, seq_lengths=(q, kv)
    )
    for ours, theirs in [(m.q_num_blocks, ref.q_num_blocks), (m.full_q_num_blocks, ref.full_q_num_blocks)]:
        assert torch.equal(ours, theirs)
    for num, ours, theirs in [
        (m.q_num_blocks, m.q_indices, ref.q_indices),
        (m.full_q_num_blocks, m.full_q_indices, ref.full_q_indices),
    ]:
        valid = torch.arange(ours.shape[-1]) < num[..., None]
        assert ours.shape == theirs.shape and torch.equal(ours[valid], theirs[valid])


def test_anchor_pack_of_a_batch_that_trains_nothing_is_one_idle_anchor():
    pack = AnchorPack.plan(torch.tensor([[4, 4], [9, 9]]), 12, 3, 4, 0, "cpu")
    assert pack.row.tolist() == [-1] and all(a.numel() == 0 and p.numel() == 0 for a, p in pack.picks)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 24])
def test_packed_training_step_matches_the_materialized_one_on_gpu(window):
    """Loss and gradients of a training step agree between the dense forward over the materialized scores
    and the packed one (FlexAttention's fused kernels, forward and backward), with the trainer's bf16
    autocast, on the torch and on the Triton norms and RoPE with the fused lm_head and loss (the trainer's
    default on CUDA)."""

    _, head = make_head(pair()[1].to("cuda"), device="cuda", seed=3, intermediate_size=64, sliding_window=window)
    head.requires_grad_(True)
    spans = torch.tensor([[10, 90], [0, 100], [50, 50], [95, 99]])  # positions + block within the target's 128
    batch = _spanned_batch(head, spans, 100, "cuda")
    batch.label_logits = batch.label_logits.to(torch.bfloat16)
    runs = []
    triton_step = functools.partial(dflash_forward_packed, ops=TRITON_OPS)
    for forward, kernel in ((dflash_forward, "torch"), (dflash_forward_packed, "torch"), (triton_step, "triton")):
        head.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(head, batch, BLOCK - 1)
        loss, _ = ttt_loss(logits, batch, kernel=kernel)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    (l0, g0) = runs[0]
    assert g0
    for l1, g1 in runs[1:]:
        torch.testing.assert_close(l1, l0, atol=2e-3, rtol=2e-3)
        assert g0.keys() == g1.keys()
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], atol=2e-3, rtol=0.05, msg=n)


@pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_training_forward_on_the_triton_ops_equals_the_torch_ops(arch):
    """train.kernels=triton runs the DFlash forward's RMSNorms (hidden_norm, the layers', the final
    norm; a Qwen3 drafter's q/k norms) and RoPE (context and block) as Triton kernels, forward and
    backward: the same logits and gradients as the modules and the torch formula (fp32)."""
    device = "cuda" if CUDA else "cpu"
    target = (qwen3_pair() if arch == "qwen3" else pair())[1].to(device)
    target.init_buffers(torch.device(device))
    _, head = make_head(target, device, seed=6)
    batch = _random_batch(head, 2, 6, device, seed=6)
    g = torch.Generator().manual_seed(6)
    batch.label_logits = torch.randn(2, 6, target.args.vocab_size, generator=g).to(device)
    batch.top = batch.label_logits.argmax(-1)
    trained = {"hidden_norm.weight", "norm.weight", "layers.1.input_layernorm.weight"}
    if arch == "qwen3":
        trained |= {"layers.1.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"}
    assert_triton_ops_match_torch_ops(dflash_forward, head, batch, K, trained)


def test_mlp_width_is_a_random_heads_key(target, tmp_path):
    """draft.intermediate_size shapes a random head's MLPs (config.json and tensors); a checkpoint
    loads at its own width, and naming a width for it is one clear error."""
    plan, head = make_head(target, intermediate_size=48)
    assert plan.head_config["intermediate_size"] == 48
    assert head.layers[0].mlp.down_proj.weight.shape[1] == 48
    _, default = make_head(target)
    assert default.layers[0].mlp.down_proj.weight.shape[1] == target.args.intermediate_size
    head.save(tmp_path)
    ckpt = dict(init="checkpoint", path=str(tmp_path), aux_layer_ids=None, block_size=None, num_layers=None)
    loaded = load_head(plan_draft(dflash_cfg(**ckpt), target.args), target, 0, torch.device("cpu"), torch.float32)
    assert loaded.layers[1].mlp.gate_proj.weight.shape == (48, target.args.hidden_size)
    with pytest.raises(ConfigError) as e:
        plan_draft(dflash_cfg(**ckpt, intermediate_size=48), target.args)
    assert e.value.key == "draft.intermediate_size"


def test_kv_heads_is_a_random_heads_key(target, tmp_path):
    """draft.num_kv_heads widens a random head's keys and values (config.json and tensors; the training
    forward against the inference block: test_training_forward_equals_the_inference_block), and a
    checkpoint loads with its own heads."""
    plan, head = make_head(target, num_kv_heads=4, seed=5)
    d = target.args.head_dim
    assert plan.head_config["num_key_value_heads"] == 4 != target.args.num_kv_heads
    assert head.layers[0].self_attn.k_proj.weight.shape == (4 * d, target.args.hidden_size)
    head.save(tmp_path)
    ckpt = dict(init="checkpoint", path=str(tmp_path), aux_layer_ids=None, block_size=None, num_layers=None)
    loaded = load_head(plan_draft(dflash_cfg(**ckpt), target.args), target, 0, torch.device("cpu"), torch.float32)
    assert loaded.layers[1].self_attn.v_proj.weight.shape == (4 * d, target.args.hidden_size)
    with pytest.raises(ConfigError) as e:
        plan_draft(dflash_cfg(**ckpt, num_kv_heads=4), target.args)
    assert e.value.key == "draft.num_kv_heads"


TRAIN = DFLASH_TRAIN


def test_train_draft_stage_trains_a_head_that_beats_a_random_one(outputs, tmp_path):
    ctx = run(compose_cfg(*TRAIN, "train.steps=150"))
    head_dir = Path(ctx["draft_checkpoint"])
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    card = (head_dir / "README.md").read_text()
    assert "DFlash block-diffusion drafter" in card and "accept_length" in card

    common = [
        "+experiment=dflash",
        *TINY,
        "model.random.init_std=0.15",
        "eval.max_new_tokens=24",
        "eval.batch_size=4",
        "draft.num_steps=3",
    ]
    assert_trained_beats_random(
        outputs,
        tmp_path,
        common,
        ["draft.init=checkpoint", f"draft.path={head_dir}", "draft.block_size=null", "draft.num_layers=null"],
        ["draft.init=random", "draft.block_size=4"],
    )


def test_train_steps_beyond_the_block_are_one_clear_error(outputs):
    with pytest.raises(PlanError, match=r"train.ttt_steps=4: a DFlash block of 4 tokens predicts 3"):
        build_plan(to_run_config(compose_cfg(*TRAIN, "train.ttt_steps=4", "device=cpu")), outputs)


@pytest.mark.parametrize("window", [None, 6])
def test_triton_attention_reads_the_whole_block(window):
    """The Triton decode-attention kernel (the CUDA default; on CPU under the interpreter) gives every
    block query the block's last slot as its bound (qpos), and with a context window each query its own
    first slot (qlo): it equals the SDPA mask, and the first draft depends on the block's last token (a
    causal block would not)."""
    device = "cuda" if CUDA else "cpu"
    _, target = pair()
    target = target.to(device)
    target.init_buffers(torch.device(device))
    plan, head = make_head(target, device, sliding_window=window)
    prompts = random_prompts(3, seed=41)
    draft = DFlashDraft(head, 3, K)
    feats, ids, valid, first = _prefill(target, prompts)
    draft.begin(None, feats, ids, valid, None, first)
    state = SpecState(
        [list(p) + [f] for p, f in zip(prompts, first.tolist())],
        [len(p) for p in prompts],
        [True] * 3,
        [0, 1, 2],
        device,
    )
    sdpa = draft_logits(draft, state)
    head.attention_kernel = True
    try:
        kernel, changed = draft_logits(draft, state), draft_logits(draft, state, last_token=7)
    finally:
        head.attention_kernel = False
    torch.testing.assert_close(kernel, sdpa, atol=1e-4, rtol=1e-4)
    assert (changed[:, 0] - kernel[:, 0]).abs().max() > 1e-3


@pytest.mark.parametrize("kv_heads", [None, 4])
def test_fused_context_write_equals_the_plain_one(kv_heads):
    """The fused context write (fc, then hidden_norm in the prologue of every layer's stacked k/v
    projection, then RoPE + cache write per layer: CUDA's path, on CPU under the interpreter) writes the
    cache the plain modules write: every layer's k and v at the valid positions' slots, the padding to
    the dummy slot only."""
    device = "cuda" if CUDA else "cpu"
    target = pair()[1].to(device)
    target.init_buffers(torch.device(device))
    _, head = make_head(target, device, seed=9, num_kv_heads=kv_heads)
    fused = head.copy(torch.device(device))
    fused.use_fused_kernels()
    b, t = 2, 5
    g = torch.Generator().manual_seed(9)
    env = {
        "feats": torch.randn(b, t, head.feature_width, generator=g).to(device),  # [b, t, F]
        "positions": (torch.tensor([[3], [11]]) + torch.arange(t)).to(device),  # [b, t]
        "valid": torch.tensor([[True] * 5, [True, True, True, False, False]], device=device),
    }
    caches = []
    for h in (head, fused):
        cache = h.new_cache(b)
        write_context(h, cache, env["feats"], env["positions"], env["valid"])
        caches.append(cache)
    plain, got = caches
    written = plain.k.abs().sum((0, 2, 4)) > 0  # [b, slots]: where the plain write put anything
    assert written[0, 3:8].all() and written[1, 11:14].all() and int(written[:, :-1].sum()) == 8
    live = slice(0, plain.k.shape[3] - 1)  # the dummy slot (last) takes padding writes in any order
    torch.testing.assert_close(got.k[:, :, :, live], plain.k[:, :, :, live], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.v[:, :, :, live], plain.v[:, :, :, live], atol=1e-4, rtol=1e-4)
