"""EAGLE3 training with training-time test, the `train_draft` stage, resume, and the round trip
of a trained head into the eval stage (acceptance above a random head's on the training prompts)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers.models import pair, spread_init
from helpers.runs import compose_cfg, metric_history
from helpers.train import EAGLE3_TRAIN as TRAIN
from helpers.train import assert_triton_ops_match_torch_ops
from mlflow.tracking import MlflowClient
from safetensors import safe_open

from engine.drafts.common.ttt import TORCH_OPS, TRITON_OPS, ttt_attention_flex
from engine.drafts.dflash.train import dflash_forward_packed
from engine.drafts.eagle3 import Eagle3Head, eagle3_config
from engine.drafts.eagle3.train import ttt_forward
from engine.drafts.train_contract import Batch, ttt_loss
from engine.model import StaticKVCache
from engine.train.acceptance import chain_acceptance, chain_lengths, simulated_loop
from engine.train.average import WeightAverage
from kernels.runtime import triton
from pipeline.__main__ import run
from pipeline.config import to_run_config
from pipeline.plan import PlanError, build_plan
from pipeline.tracking import default_tracking_uri


def _head_and_batch(b=2, t=12, seed=0, device="cpu", lm_head="own"):
    _, target = pair()
    head = spread_init(Eagle3Head(eagle3_config(target.args, [0, 1, 2], None, lm_head), max(64, t)), seed=seed, std=0.1)
    head.bind(target.to(device)).to(device)
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, t, head.fc.in_features, generator=g)
    tokens = torch.randint(0, 320, (b, t), generator=g)
    positions = torch.arange(t).expand(b, t)
    label_logits = 2 * torch.randn(b, t, 320, generator=g)
    batch = Batch(tokens, positions, feats, label_logits, label_logits.argmax(-1), torch.ones(b, t, dtype=torch.bool))
    return head, Batch(
        *(x.to(device) for x in (batch.tokens, batch.positions, batch.feats, batch.label_logits, batch.top, batch.mask))
    )


@torch.no_grad()
def _inference_chain(head, batch: Batch, row: int, anchor: int, steps: int) -> list[torch.Tensor]:
    """Logits of a chain anchored at `anchor`, computed the way FeatureDraft runs at inference: the draft
    extend over positions 0..anchor with the target's features, then one step at a time on the draft's
    own hidden state (teacher-forced tokens), each through the head's forward over its KV cache."""
    cache = StaticKVCache(head.args, 1, head.max_seq_len, batch.tokens.device, torch.float32)
    n = anchor + 1
    a = head.attn_inputs(batch.positions[row : row + 1, :n], None, n)
    o = head(batch.feats[row : row + 1, :n], cache, a, tokens=batch.tokens[row : row + 1, :n])
    out, h = [o.logits[0, -1]], o.hidden[:, -1:]
    for s in range(1, steps):
        p = anchor + s
        a = head.attn_inputs(batch.positions[row : row + 1, p : p + 1], None, p + 1)
        o = head(h, cache, a, tokens=batch.tokens[row : row + 1, p : p + 1])
        out.append(o.logits[0, -1])
        h = o.hidden
    return out


@pytest.mark.parametrize("lm_head", ["own", "target"])
@pytest.mark.parametrize("anchor", [0, 3, 6])
def test_ttt_unroll_equals_the_inference_chain(anchor, lm_head):
    """Step s of the unrolled forward at position anchor + s is exactly what the draft computes at
    inference for a chain anchored there: same hidden inputs and the same keys (the step-0 prefix plus one
    diagonal key per earlier step). A wrong attention pattern fails here."""
    head, batch = _head_and_batch(lm_head=lm_head)
    steps = 4
    with torch.no_grad():
        unrolled = ttt_forward(head, batch, steps)
    for row in range(2):
        chain = _inference_chain(head, batch, row, anchor, steps)
        for s in range(steps):
            torch.testing.assert_close(unrolled[s][row, anchor + s], chain[s], atol=2e-5, rtol=1e-4)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("t", [40, 200])  # one FlexAttention block (padded to two), and two
def test_flex_attention_unroll_equals_the_materialized_one(t):
    """FlexAttention's block mask is the same attention as the materialized scores on every row a loss
    reads (p >= s). CPU runs FlexAttention's reference forward; the GPU test below covers the backward."""
    head, batch = _head_and_batch(b=2, t=t)
    with torch.no_grad():
        ref = ttt_forward(head, batch, 5)
        flex = ttt_forward(head, batch, 5, attention=ttt_attention_flex)
    for s, (a, b) in enumerate(zip(ref, flex)):
        torch.testing.assert_close(b[:, s:], a[:, s:], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [60, 200])
def test_flex_attention_training_step_matches_the_materialized_one_on_gpu(t):
    head, batch = _head_and_batch(b=3, t=t, device="cuda")
    head.requires_grad_(True)
    grads = []
    for attention in (None, ttt_attention_flex):
        head.zero_grad(set_to_none=True)
        kw = {} if attention is None else {"attention": attention}
        loss, _ = ttt_loss(ttt_forward(head, batch, 5, **kw), batch)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, atol=1e-4, rtol=1e-4)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-4, rtol=1e-3, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_attention_compiles_once_for_every_width_and_step():
    """Training meets a new width every few batches and TTT steps 0..4 at each: one compiled kernel (a
    recompile costs 10-20 s of the recipe's time budget)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for t in (300, 512, 100, 200, 60):
        for s in range(5):
            q = torch.randn(4, 9, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            kv = [torch.randn(4, 3, t, 64, device="cuda", dtype=torch.bfloat16) for _ in range(s + 1)]
            ttt_attention_flex(q, kv, kv, 3).float().sum().backward()
            assert q.grad.shape == q.shape
    assert counters["stats"]["unique_graphs"] == 1


def test_ttt_loss_and_gradient_reach_every_trained_tensor():
    head, batch = _head_and_batch()
    head.requires_grad_(True)
    loss, stats = ttt_loss(ttt_forward(head, batch, 3), batch)
    loss.backward()
    assert loss.item() > 0 and set(stats) == {f"{k}_{s}" for k in ("loss", "acc") for s in range(3)}
    for name, p in head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert head.embed.weight.grad is None  # the target's embedding stays frozen


def _half_right(head, batch: Batch, steps: int) -> list[torch.Tensor]:
    """The batch's next tokens set to the head's own step-0 greedy draft at half the positions (so chains
    run on past step 0), and the head's logits on it."""
    with torch.no_grad():
        own = ttt_forward(head, batch, 1)[0].argmax(-1)  # [B, T]: step 0 does not read the labels
    pick = torch.rand(batch.top.shape, generator=torch.Generator().manual_seed(3)).to(own.device) < 0.5
    batch.top = torch.where(pick, own, batch.top)
    return ttt_forward(head, batch, steps)


def test_ttt_loss_is_the_decayed_mean_of_each_steps_cross_entropy():
    """Step s's loss is the mean cross-entropy over its valid positions (p >= s, in the answer), and the
    steps are averaged with weights decay ** s: against a per-position loop."""
    head, batch = _head_and_batch(t=16)
    batch.mask[0, :3] = False
    steps, decay = 3, 0.7
    logits = _half_right(head, batch, steps)
    loss, stats = ttt_loss(logits, batch, decay=decay)
    b, t = batch.mask.shape
    want = 0.0
    for s in range(steps):
        terms = [
            -(batch.labels[r, p] * torch.log_softmax(logits[s][r, p].float(), -1)).sum()
            for r in range(b)
            for p in range(s, t)
            if batch.mask[r, p]
        ]
        want = want + decay**s * torch.stack(terms).mean()
        right = [
            bool(logits[s][r, p].argmax() == batch.top[r, p]) for r in range(b) for p in range(s, t) if batch.mask[r, p]
        ]
        assert stats[f"acc_{s}"].item() == pytest.approx(sum(right) / len(right))
    torch.testing.assert_close(loss, want / sum(decay**s for s in range(steps)))


@pytest.mark.skipif(triton is None, reason="triton is not installed")
def test_ttt_loss_on_the_fused_kernel_equals_the_torch_loss():
    """The Triton soft cross-entropy (TRITON_INTERPRET=1 on CPU) gives ttt_loss the same loss, per-step
    figures and gradients as the plain-torch path, at a label temperature, with masked positions."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    head, batch = _head_and_batch(device=device)
    batch.mask[0, :4] = False
    batch.label_temperature = 0.5
    head.requires_grad_(True)
    _half_right(head, batch, 1)
    out = {}
    for kernel in ("torch", "triton"):
        loss, stats = ttt_loss(ttt_forward(head, batch, 3), batch, kernel=kernel)
        head.zero_grad()
        loss.backward()
        out[kernel] = loss, stats, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    (l0, s0, g0), (l1, s1, g1) = out["torch"], out["triton"]
    torch.testing.assert_close(l1, l0)
    assert s0.keys() == s1.keys() and all(torch.allclose(s1[k], s0[k], atol=1e-5) for k in s0)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.skipif(triton is None, reason="triton is not installed")
def test_ttt_forward_on_the_triton_ops_equals_the_torch_ops():
    """train.kernels=triton also runs the EAGLE3 forward's RMSNorms and RoPE as Triton kernels (forward
    and backward): the same logits and gradients as the modules and apply_rope (fp32)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    head, batch = _head_and_batch(device=device)
    trained = {
        "midlayer.hidden_norm.weight",
        "norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.k_proj.weight",
    }
    assert_triton_ops_match_torch_ops(ttt_forward, head, batch, 3, trained)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ttt_forward_on_the_triton_ops_under_bf16_autocast_on_gpu():
    """As the trainer runs it on CUDA (bf16 autocast, FlexAttention): the Triton norms and RoPE give the
    torch ops' logits and gradients up to bf16 rounding."""
    head, batch = _head_and_batch(b=4, t=64, device="cuda")
    head.requires_grad_(True)
    out = {}
    for ops in (TORCH_OPS, TRITON_OPS):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = ttt_forward(head, batch, 3, attention=ttt_attention_flex, ops=ops)
        head.zero_grad()
        ttt_loss(logits, batch, kernel="triton")[0].backward()
        out[ops] = (
            [lg.float() for lg in logits],
            {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None},
        )
    (l0, g0), (l1, g1) = out[TORCH_OPS], out[TRITON_OPS]
    for a, b in zip(l0, l1):
        torch.testing.assert_close(b, a, atol=0.05, rtol=0.02)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-3, rtol=0.05, msg=n)


def test_training_forward_follows_attention_and_kernels():
    from engine.drafts.registry import TRAIN_SPECS
    from engine.train.trainer import train_attention, train_kernels, training_forward

    t = to_run_config(compose_cfg(*TRAIN, "device=cpu")).train
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # only their type is read
    fast = ("flex", "triton")
    forward = lambda name, ak: (lambda f: (f.func, f.keywords))(training_forward(TRAIN_SPECS[name], *ak))  # noqa: E731
    eagle3, dflash, mtp = (TRAIN_SPECS[n] for n in ("eagle3", "dflash", "multi_layer_eagle"))
    plain = (train_attention(t.attention, eagle3, cpu), train_kernels(t.kernels, cpu))  # CPU: auto is eager, torch
    assert plain == ("eager", "torch")
    assert forward("eagle3", fast) == (eagle3.forward, {"attention": ttt_attention_flex, "ops": TRITON_OPS})
    assert forward("dflash", fast) == (dflash_forward_packed, {"ops": TRITON_OPS})  # the trained anchors only
    assert forward("dflash", plain) == (dflash.forward, {})
    assert forward("multi_layer_eagle", fast) == (mtp.forward, {})  # neither exists there
    assert forward("eagle3", plain) == (eagle3.forward, {})
    assert train_attention("auto", dflash, cuda) == train_attention("auto", eagle3, cuda) == "flex"
    assert train_attention("auto", mtp, cuda) == "eager" == train_attention("auto", dflash, cpu)


def test_triton_train_kernels_need_cuda_or_the_interpreter(outputs, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(PlanError) as e:
        build_plan(to_run_config(compose_cfg(*TRAIN, "train.kernels=triton", "device=cpu")))
    assert "train.kernels" in str(e.value) and "TRITON_INTERPRET" in str(e.value)


def test_lr_schedule_warms_up_then_follows_steps_or_time_down_to_the_floor():
    from engine.train.trainer import lr_at

    s = to_run_config(
        compose_cfg(
            *TRAIN, "train.lr=1e-3", "train.warmup_steps=10", "train.steps=110", "train.min_lr_ratio=0.25", "device=cpu"
        )
    ).train
    assert lr_at(0, 0.0, s) == pytest.approx(1e-4) and lr_at(9, 0.0, s) == pytest.approx(1e-3)
    assert lr_at(60, 0.0, s) == pytest.approx(1e-3 * (0.25 + 0.75 * 0.5))  # half way down the cosine
    assert lr_at(110, 0.0, s) == pytest.approx(2.5e-4) == lr_at(500, 0.0, s)  # the floor, and it stays
    timed = dataclasses.replace(s, max_time_s=100.0, min_lr_ratio=0.0)
    assert lr_at(20, 50.0, timed) == pytest.approx(5e-4)  # time ahead of steps: half the budget used
    assert lr_at(20, 100.0, timed) == pytest.approx(0.0)


def test_chain_acceptance_counts_chains_not_positions():
    # One row, 6 positions, k=3; step s is right at the positions listed.
    t, k = 6, 3
    right = {0: {0, 1, 2, 3}, 1: {1, 3, 4}, 2: {2, 5}}
    top = torch.zeros(1, t, dtype=torch.long)
    logits = []
    for s in range(k):
        lg = torch.zeros(1, t, 2)
        for p in range(t):
            lg[0, p, 0 if p in right[s] else 1] = 1.0
        logits.append(lg)
    batch = Batch(top, top, None, None, top, torch.ones(1, t, dtype=torch.bool))
    accepted, anchors = chain_acceptance(chain_lengths(logits, batch, k), batch.mask, k)
    # anchors j with j + 2 < 6: 0..3. Step 0 right at j: 0,1,2,3; step 1 at j+1: j=0,2,3; step 2 at j+2: j=0,3
    assert int(anchors) == 4 and accepted.tolist() == [4, 3, 2]


def test_simulated_loop_replays_rounds_from_chain_lengths():
    # Row 0: trained positions 2..8 (the first answer token x_P is predicted at p = 2 by the prefill), so
    # rounds anchor from 3 and 6 tokens are left. Lengths 2 at 3, 0 at 6, 5 at 7 (cut by the end).
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 2:9] = True
    mask[1, 0:2] = True  # row 1: one token left after the prefill's -> one round of one token
    length = torch.zeros(2, 10, dtype=torch.long)
    length[0, 3], length[0, 6], length[0, 7] = 2, 0, 5
    length[0, 4] = 4  # skipped over by the round at 3: never an anchor
    tokens, rounds, anchors = simulated_loop(length, mask)
    assert (tokens, rounds) == (3 + 1 + 2 + 1, 4)
    assert anchors.nonzero().tolist() == [[0, 3], [0, 6], [0, 7], [1, 1]]
    # A horizon of 3 new tokens (the prefill's included): the round at 3 crosses it and counts whole
    tokens, rounds, anchors = simulated_loop(length, mask, horizon=3)
    assert (tokens, rounds) == (3 + 1, 2)
    assert anchors.nonzero().tolist() == [[0, 3], [1, 1]]


def _replay_walk(length, mask, horizon=None):
    """The loop replayed by walking each row's rounds in Python: the reference for the pointer doubling."""
    anchors, tokens = torch.zeros(mask.shape, dtype=torch.bool), 0
    for row, (lengths, trained) in enumerate(zip(length.tolist(), mask)):
        idx = trained.nonzero().flatten().tolist()
        if len(idx) < 2:
            continue
        j, stop = idx[0] + 1, idx[-1] + 1
        end = stop if horizon is None else min(stop, idx[0] + horizon)
        while j < end:
            anchors[row, j] = True
            tokens += min(lengths[j] + 1, stop - j)
            j += lengths[j] + 1
    return tokens, int(anchors.sum()), anchors


@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_loop_anchors_by_pointer_doubling_equal_the_walk(t):
    """Random chain lengths (0..k, runs of zeros: the longest paths) and masks (prompts, padding, rows with
    0, 1 or all positions trained), with and without a horizon."""
    g = torch.Generator().manual_seed(t)
    b = 24
    length = torch.randint(0, 6, (b, t), generator=g) * (torch.rand(b, t, generator=g) < 0.6)
    first = torch.randint(0, t, (b,), generator=g)
    last = torch.minimum(first + torch.randint(0, t + 1, (b,), generator=g), torch.tensor(t - 1))
    pos = torch.arange(t)
    mask = (pos >= first[:, None]) & (pos <= last[:, None])
    mask[0], mask[1] = False, pos == min(3, t - 1)  # nothing trained; one trained position
    if t > 1:
        mask[2], length[2] = True, 0  # every position trained, every chain rejected: the longest path
    for horizon in (None, 1, 5, 40):
        want = _replay_walk(length, mask, horizon)
        got = simulated_loop(length, mask, horizon)
        assert got[:2] == want[:2] and torch.equal(got[2], want[2]), horizon


# ------------------------------------------------------------------------------------------ the stage
def test_train_draft_stage_trains_exports_resumes_and_drafts(outputs, tmp_path):
    # eval_k = draft.num_steps and no sample cut by max_len: the replayed loop of the held-out evaluation
    # is then the real loop on the same prompts (in fp32: TRAIN's dtype), both stopping at 16 new tokens
    # of answers up to 24 long
    ctx = run(compose_cfg(*TRAIN, "train.steps=40", "train.eval_k=5", "train.loop_eval_tokens=16", "train.max_len=128"))
    head_dir = Path(ctx["draft_checkpoint"])
    assert head_dir == outputs / "train" / "train_eagle3_smollm2" / "head"
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 96
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16  # the export's dtype
        d2t = f.get_tensor("d2t")
    card = (head_dir / "README.md").read_text()
    assert "accept_length" in card and "of them cut at" in card  # the share of user messages cut

    client = MlflowClient(default_tracking_uri(outputs))
    exp = client.get_experiment_by_name("train_eagle3_smollm2")
    (r,) = client.search_runs([exp.experiment_id])
    assert r.info.status == "FINISHED"
    val = metric_history(client, r.info.run_id, "val_loss")
    assert val[0][0] == 0 and val[-1][0] == 40 and val[-1][1] < val[0][1]  # the held-out loss falls
    assert len(metric_history(client, r.info.run_id, "train_loss")) == 4
    assert "val_accept_rate_pos_2" in r.data.metrics
    # the real draft-and-verify loop on held-out prompts (k = draft.num_steps = 5): one or more per round
    assert 1.0 <= r.data.metrics["heldout_loop_accept_length_k5"] <= 6.0
    assert r.data.metrics["heldout_loop_prompts"] == 4.0
    assert r.data.metrics["val_loop_accept_length_k5"] == pytest.approx(r.data.metrics["heldout_loop_accept_length_k5"])
    # a 96-token draft vocabulary of a 320-token target covers part of the held-out answers' tokens
    assert 0.2 < r.data.metrics["val_draft_vocab_coverage"] < 1.0
    arts = {a.path for a in client.list_artifacts(r.info.run_id, "draft_head")}
    assert {"draft_head/model.safetensors", "draft_head/config.json", "draft_head/README.md"} <= arts

    # Resume: the same experiment with more steps continues from step 40 on the cached data.
    ctx = run(compose_cfg(*TRAIN, "train.steps=50"))
    state = torch.load(
        outputs / "train" / "train_eagle3_smollm2" / "checkpoint" / "trainer_state.pt", weights_only=False
    )
    assert state["step"] == 50
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    second = runs[0].info.run_id
    assert [s for s, _ in metric_history(client, second, "train_loss")] == [50]  # no step before 40 re-ran
    assert runs[0].data.metrics["data_reused"] == 1.0  # the cached samples
    assert runs[0].data.metrics["data_s"] == runs[1].data.metrics["data_s"]  # their synthesis time, recorded
    first = runs[1].data.metrics  # and its phases: graph capture, the user messages, the answers
    phases = [first[f"data_{k}_s"] for k in ("graphs", "messages", "answers")]
    assert all(v >= 0 for v in phases) and phases[1] > 0 and phases[2] > 0 and sum(phases) <= first["data_s"]
    assert all(runs[0].data.metrics[f"data_{k}_s"] == first[f"data_{k}_s"] for k in ("graphs", "messages", "answers"))
    # and their user messages cut at max_prompt_tokens (a random tiny target seldom ends its turn)
    assert runs[0].data.metrics["data_prompts_cut"] == runs[1].data.metrics["data_prompts_cut"] > 0

    # The exported head loads as a checkpoint and drafts: on the training prompts it is accepted more
    # often than a random head of the same shape, and the output stays the target's.
    (data,) = (outputs / "train" / "data").glob("*/samples.jsonl")  # one synthesis, keyed by its settings
    samples = [json.loads(line) for line in open(data)]
    qfile = tmp_path / "question.jsonl"
    qfile.write_text(
        "".join(json.dumps({"question_id": i, "turns": [s["user"]]}) + "\n" for i, s in enumerate(samples))
    )
    common = [
        "+experiment=eagle3",
        "model=tiny",
        "model.random.init_std=0.15",
        "draft.aux_layer_ids=[1,2,3]",
        f"eval.dataset={qfile}",
        "eval.max_new_tokens=24",
        "eval.batch_size=4",
        "draft.num_steps=3",
        "tracking=off",
    ]
    trained = run(compose_cfg(*common, "draft.init=checkpoint", f"draft.path={head_dir}"))["eval_results"]["metrics"]
    random_ = run(compose_cfg(*common, "draft.init=random", "draft.draft_vocab_size=96"))["eval_results"]["metrics"]
    assert trained["match_baseline"] == 1.0
    assert trained["accept_length"] > random_["accept_length"] + 0.2, (
        trained["accept_length"],
        random_["accept_length"],
    )
    assert d2t.shape == (96,)


def test_a_loss_that_goes_nan_stops_the_run_with_one_clear_error(outputs):
    """A diverged run stops at the first logged step whose loss is not finite and its MLflow run is FAILED,
    rather than spending its time budget training on NaN; no head is exported."""
    with pytest.raises(FloatingPointError, match=r"train_loss=nan at step \d+ .*train.kernels=torch"):
        run(compose_cfg(*TRAIN, "train.steps=40", "train.lr=1e30"))
    client = MlflowClient(default_tracking_uri(outputs))
    (r,) = client.search_runs([client.get_experiment_by_name("train_eagle3_smollm2").experiment_id])
    assert r.info.status == "FAILED"
    assert not (outputs / "train" / "train_eagle3_smollm2" / "head").exists()


def test_eagle3_head_on_the_target_lm_head_trains_and_drafts_every_token(outputs):
    """draft.lm_head=target: the head predicts through the target's lm_head (frozen, shared), so the
    export stores no lm_head, d2t or t2d and its config.json no draft_vocab_size (sglang then loads the
    lm_head from the target); every answer token is in its vocabulary; it trains and loads back."""
    ctx = run(
        compose_cfg(
            *TRAIN,
            "draft.draft_vocab_size=null",
            "draft.lm_head=target",
            "train.steps=30",
            "train.loop_eval_prompts=0",
            "train.name=shared",
        )
    )
    head_dir = Path(ctx["draft_checkpoint"])
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and "draft_vocab_size" not in cfg
    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and not keys & {"lm_head.weight", "d2t", "t2d"}
    assert "target's lm_head" in (head_dir / "README.md").read_text()
    client = MlflowClient(default_tracking_uri(outputs))
    (r,) = client.search_runs([client.get_experiment_by_name("train_eagle3_smollm2").experiment_id])
    val = metric_history(client, r.info.run_id, "val_loss")
    assert val[-1][0] == 30 and val[-1][1] < val[0][1]  # the held-out loss falls
    assert r.data.metrics["val_draft_vocab_coverage"] == 1.0

    trained = run(
        compose_cfg(
            "+experiment=eagle3",
            "model=tiny",
            "model.random.init_std=0.15",
            "draft.aux_layer_ids=[1,2,3]",
            "eval.limit=2",
            "eval.max_new_tokens=16",
            "draft.num_steps=3",
            "tracking=off",
            "draft.init=checkpoint",
            f"draft.path={head_dir}",
        )
    )
    head, target = trained["draft_head"], trained["target"].model
    assert head.shares_lm_head and head.lm_head is target.lm_head
    assert trained["eval_results"]["metrics"]["match_baseline"] == 1.0


def test_label_temperature_trains_on_sharpened_labels_and_evaluates_on_the_targets_own(outputs):
    """train.label_temperature changes what the head trains on, not what it is scored against: from the
    same seeded head on the same samples, the held-out loss before training is the same at T = 0.25 as
    at T = 1 (the target's own distribution), and the trained heads differ."""
    common = [*TRAIN, "train.steps=20", "train.loop_eval_prompts=0"]
    soft = run(compose_cfg(*common, "train.name=soft", "train.label_temperature=1"))  # the recipe's: the target's own
    sharp = run(compose_cfg(*common, "train.name=sharp", "train.label_temperature=0.25"))
    client = MlflowClient(default_tracking_uri(outputs))
    runs = client.search_runs(
        [client.get_experiment_by_name("train_eagle3_smollm2").experiment_id], order_by=["attributes.start_time ASC"]
    )
    assert len(runs) == 2 and runs[0].data.metrics["data_reused"] == 0 and runs[1].data.metrics["data_reused"] == 1
    soft_val, sharp_val = (metric_history(client, r.info.run_id, "val_loss") for r in runs)
    assert soft_val[0] == sharp_val[0]  # step 0: the same head scored on the same labels
    assert soft_val[-1][0] == sharp_val[-1][0] == 20 and soft_val[-1][1] != sharp_val[-1][1]
    with (
        safe_open(str(Path(soft["draft_checkpoint"]) / "model.safetensors"), "pt") as a,
        safe_open(str(Path(sharp["draft_checkpoint"]) / "model.safetensors"), "pt") as b,
    ):
        assert not torch.equal(a.get_tensor("fc.weight"), b.get_tensor("fc.weight"))
    card = (Path(sharp["draft_checkpoint"]) / "README.md").read_text()
    assert (
        "at temperature 0.25" in card
        and "at temperature" not in (Path(soft["draft_checkpoint"]) / "README.md").read_text()
    )


def test_weight_average_follows_the_warmed_up_ema_and_swaps_in_and_out():
    """WeightAverage: shadow <- shadow + (1 - d_t) (param - shadow), d_t = min(decay, (1 + t) / (10 + t)),
    against a plain per-tensor reference; `applied` holds the average inside and gives the parameters
    back after; the state round-trips into a fresh average."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    avg = WeightAverage(params, decay=0.9)
    ref = [p.clone() for p in params]
    for step in range(30):
        for p in params:
            p.add_(torch.randn(p.shape, generator=g))
        avg.update(step)
        d = min(0.9, (1 + step) / (10 + step))
        ref = [r * d + p * (1 - d) for r, p in zip(ref, params)]
    assert all(torch.allclose(s, r, atol=1e-6) for s, r in zip(avg.shadow, ref))
    own = [p.clone() for p in params]
    with avg.applied():
        assert all(torch.equal(p, r) for p, r in zip(params, avg.shadow))
    assert all(torch.equal(p, o) for p, o in zip(params, own))
    fresh = WeightAverage(params, decay=0.9)
    fresh.load_state_dict(avg.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.shadow, avg.shadow))
    fresh.copy_to_params()
    assert all(torch.equal(p, r) for p, r in zip(params, avg.shadow))
    with pytest.raises(ValueError, match="decay"):
        WeightAverage(params, decay=1.0)


def test_ema_head_is_exported_beside_the_last_steps_weights_and_resumes(outputs):
    """train.ema_decay: the head is the average (its held-out figures are the run's val_*), the last step's
    own weights go to head_last with their figures as last_val_*; the cards say which is which; the
    checkpoint keeps the raw weights and the average, so a resumed run averages on."""
    common = [*TRAIN, "train.loop_eval_prompts=0", "train.ema_decay=0.9"]
    ctx = run(compose_cfg(*common, "train.steps=30"))
    out = Path(ctx["draft_checkpoint"]).parent
    heads = {}
    for name in ("head", "head_last"):
        with safe_open(str(out / name / "model.safetensors"), "pt") as f:
            heads[name] = {k: f.get_tensor(k) for k in f.keys()}
    assert heads["head"].keys() == heads["head_last"].keys()
    assert torch.equal(heads["head"]["d2t"], heads["head_last"]["d2t"])  # one vocabulary, two weight sets
    assert not torch.equal(heads["head"]["fc.weight"], heads["head_last"]["fc.weight"])
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    with safe_open(str(out / "checkpoint" / "model.safetensors"), "pt") as f:  # the raw weights, fp32
        assert torch.equal(f.get_tensor("fc.weight").to(torch.bfloat16), heads["head_last"]["fc.weight"])
    assert state["ema"]["decay"] == 0.9 and len(state["ema"]["shadow"]) > 0
    client = MlflowClient(default_tracking_uri(outputs))
    (r,) = client.search_runs([client.get_experiment_by_name("train_eagle3_smollm2").experiment_id])
    m = r.data.metrics
    assert m["val_loss"] != m["last_val_loss"] and "last_val_accept_length_k3" in m
    facts = {n: json.loads((out / n / "training.json").read_text()) for n in ("head", "head_last")}
    assert facts["head"]["weights"] == "ema" and facts["head_last"]["weights"] == "last"
    assert facts["head_last"]["metrics"]["val_loss"] == pytest.approx(m["last_val_loss"], abs=1e-4)
    assert facts["head_last"]["metrics"]["train_steps"] == 30
    card = (out / "head" / "README.md").read_text()
    # the command: the job's command line; a run composed in-process has none, so the card names the recipe
    assert "(`python -m pipeline +experiment=train_eagle3_smollm2`)" in card and "decay 0.9" in card
    assert "exponential moving average" in card
    assert "last step's own weights" in (out / "head_last" / "README.md").read_text()

    run(compose_cfg(*common, "train.steps=35"))  # resumes at 30: the average goes on from the saved one
    resumed = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert resumed["step"] == 35
    assert not torch.equal(resumed["ema"]["shadow"][0], state["ema"]["shadow"][0])
    run(compose_cfg(*common, "train.steps=36", "train.ema_decay=0"))  # no average: no stale head_last
    assert (out / "head").is_dir() and not (out / "head_last").exists()


@pytest.mark.parametrize(
    "override, key",
    [
        (["train.heldout=1.5"], "train.heldout"),
        (["train.data.batch_size=0"], "train.data.batch_size"),
        (["train.max_len=4096"], "train.max_len"),
        (["train.steps=0"], "train.steps"),
        (["train.attention=flex"], "train.attention"),  # FlexAttention trains on CUDA only
        (["train.attention=fast"], "train.attention"),
        (["train.label_temperature=0"], "train.label_temperature"),
        (["train.kernels=fused"], "train.kernels"),
        (["train.min_lr_ratio=1.5"], "train.min_lr_ratio"),
        (["train.ema_decay=1"], "train.ema_decay"),
        (["draft.lm_head=tied"], "draft.lm_head"),
        (["draft.lm_head=target"], "draft.draft_vocab_size"),  # TRAIN sets a draft vocabulary
        (["draft.intermediate_size=0"], "draft.intermediate_size"),
        (["draft.init=checkpoint", "draft.intermediate_size=256"], "draft.intermediate_size"),  # the checkpoint's
    ],
)
def test_bad_train_config_is_one_clear_error(outputs, override, key):
    with pytest.raises(PlanError) as e:
        build_plan(to_run_config(compose_cfg(*TRAIN, *override, "device=cpu")))
    assert key in str(e.value)
    assert not (outputs / "train").exists()  # nothing written


def test_a_draft_without_a_trainer_is_one_clear_error(outputs):
    with pytest.raises(PlanError) as e:
        build_plan(to_run_config(compose_cfg("model=tiny", "device=cpu", "task=train_draft", "draft=ngram")))
    assert "draft.algorithm='ngram': no trainer for this draft" in str(e.value), e.value


# ------------------------------------------------------------------------------------------ the shipped head
SHIPPED = Path(__file__).resolve().parents[1] / "engine" / "drafts" / "checkpoints" / "smollm2-135m-instruct-eagle3"


def test_a_head_card_is_the_template_filled_from_its_training_json(tmp_path):
    """engine/train/card.py writes README.md from card.md, the head's training.json and config.json and the
    algorithm's own words (its TrainSpec): the shipped head's facts give its command, its settings' words
    (weight decay, EMA) and its figures; other settings change those words and nothing is left unfilled."""
    import shutil

    from engine.drafts.registry import TRAIN_SPECS
    from engine.train.card import TEMPLATE, card_text, stored_tensors, write_card

    spec = TRAIN_SPECS["eagle3"]
    for name in ("training.json", "config.json", "model.safetensors"):
        shutil.copy(SHIPPED / name, tmp_path / name)
    write_card(tmp_path, spec.summary, spec.objective)
    card = (tmp_path / "README.md").read_text()
    facts = json.loads((SHIPPED / "training.json").read_text())
    config = json.loads((SHIPPED / "config.json").read_text())
    tensors = stored_tensors(SHIPPED / "model.safetensors")
    assert card == card_text(facts, config, tensors, spec.summary, spec.objective)
    assert card.startswith("# eagle3 draft head for smollm2-135m-instruct") and "{" not in card
    assert TEMPLATE.split("{")[0] in card and "## How it was trained" in card and "## Acceptance measured" in card
    assert "(`python -m pipeline +experiment=train_eagle3_smollm2`)" in card  # no command recorded: the recipe
    assert "`LlamaForCausalLMEagle3`: `d2t`, `fc`, `lm_head`, `midlayer.*`, `norm`, `t2d`" in card
    assert f"{facts['draft_vocab_size']}-token draft vocabulary" in card
    assert "weight decay 0.1" in card and "moving average" in card
    k = facts["train"]["eval_k"]
    assert f"accept_length {facts['metrics'][f'val_accept_length_k{k}']:.2f} (bonus token included)" in card
    facts["train"].update(weight_decay=0.0, ema_decay=0.0)
    facts.update(command="python -m pipeline +experiment=train_eagle3_smollm2 train.lr=0.001", lm_head="target")
    card = card_text(facts, config, tensors, spec.summary, spec.objective)
    assert "(`python -m pipeline +experiment=train_eagle3_smollm2 train.lr=0.001`)" in card
    assert "weight decay" not in card and "moving average" not in card
    assert "the target's lm_head" in card and "target's whole vocabulary" in card
