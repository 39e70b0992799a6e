"""Draft checkpoints, aux layer ids and the speculative path through the whole pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.models import pair, random_prompts
from helpers.runs import compose_cfg, download_text, runs_of
from safetensors import safe_open

from engine import aux_layers
from engine.drafts.base import DraftHead, FeatureHead
from engine.drafts.common.feature import make_feature
from engine.drafts.eagle3 import Eagle3Head, eagle3_config
from engine.drafts.registry import ALGORITHMS, DRAFTS, algorithm, draft_config, load_head, make_draft, plan_draft
from engine.errors import ConfigError
from engine.model import init_normal_
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator
from pipeline.__main__ import run
from pipeline.config import to_run_config
from pipeline.plan import PlanError, build_plan

TINY = ("model=tiny", "eval.limit=3", "eval.max_new_tokens=12", "device=cpu")


# ------------------------------------------------------------------------------------------ aux ids
def test_aux_conventions_and_defaults():
    assert aux_layers.normalise([1, 15, 26], "output_of", 30) == (2, 16, 27)
    assert aux_layers.normalise([2, 16, 27], "input_of", 30) == (2, 16, 27)
    a = aux_layers.resolve(None, "input_of", None, 30)
    assert (a.input_of, a.output_of, a.source) == ((2, 15, 27), (1, 14, 26), "default")
    assert "input_of [2, 15, 27] = output_of [1, 14, 26] (from default)" in a.describe()


@pytest.mark.parametrize(
    "ids, conv, needle",
    [
        ([2, 2, 5], "input_of", "duplicate"),
        ([0, 31], "input_of", "[0, 30]"),
        ([30], "output_of", "[0, 29]"),
        ([-1], "input_of", "out of range"),
        ([1], "inputs_of", "draft.aux_layer_convention='inputs_of'"),
    ],
)
def test_bad_aux_ids(ids, conv, needle):
    with pytest.raises(ConfigError) as e:
        aux_layers.normalise(ids, conv, 30)
    assert needle in str(e.value)


def test_checkpoint_ids_vs_config_override():
    ckpt = [1, 14, 26]  # public checkpoints list output_of ids
    assert aux_layers.resolve(None, "input_of", ckpt, 30).input_of == (2, 15, 27)
    over = aux_layers.resolve([3, 10, 20], "input_of", ckpt, 30)
    assert (over.input_of, over.source) == ((3, 10, 20), "config")


# ------------------------------------------------------------------------------------------ checkpoints
def saved_head(tmp_path: Path, target, aux_output_of=(0, 1, 2), draft_vocab=200) -> Path:
    head = init_normal_(Eagle3Head(eagle3_config(target.args, list(aux_output_of), draft_vocab), 64), seed=4)
    head.d2t.copy_(torch.arange(draft_vocab) // 3)  # a non-trivial draft -> target mapping
    head.t2d.zero_()
    head.t2d[torch.arange(draft_vocab) + head.d2t] = True
    head.save(tmp_path / "eagle3")
    return tmp_path / "eagle3"


def test_the_temperature_factor_is_the_key_else_the_heads_config_else_one(tmp_path):
    """draft.temperature_factor wins; null takes the checkpoint's config.json draft_temperature_factor (the
    shipped heads carry a measured one), and a head without it drafts at the request's temperature. The
    plan line says a factor other than 1; a bad one, from either place, is a ConfigError naming where."""
    _, target = pair()
    path = saved_head(tmp_path, target)
    config = json.loads((path / "config.json").read_text())

    def plan(**keys):
        return plan_draft(draft_config("eagle3", init="checkpoint", path=str(path), **keys), target.args)

    assert plan().temperature_factor == 1.0 and "sampled proposals" not in plan().describe()
    (path / "config.json").write_text(json.dumps({**config, "draft_temperature_factor": 1.5}))
    own = plan()
    assert own.temperature_factor == 1.5 and "sampled proposals at T x 1.5" in own.describe()
    assert plan(temperature_factor=1.2).temperature_factor == 1.2
    head = load_head(own, target, 0, torch.device("cpu"), torch.float32)
    assert make_draft(own, head, target, 1, 3).temperature_factor == 1.5
    with pytest.raises(ConfigError, match="draft.temperature_factor=0.0"):
        plan(temperature_factor=0.0)
    (path / "config.json").write_text(json.dumps({**config, "draft_temperature_factor": "hot"}))
    with pytest.raises(ConfigError, match="draft_temperature_factor 'hot' is not a positive number"):
        plan()


def test_eagle3_mlp_width_of_a_random_head_round_trips(tmp_path):
    """draft.intermediate_size narrows a random-init head's MLP (room for a larger draft vocabulary in a
    size budget); the export says so in config.json and loads back as a checkpoint of that width."""
    _, target = pair()
    cfg = draft_config("eagle3", init="random", draft_vocab_size=200, intermediate_size=48, aux_layer_ids=[1, 2, 3])
    plan = plan_draft(cfg, target.args)
    assert "draft vocab 200, MLP 48" in plan.describe()
    head = load_head(plan, target, 0, torch.device("cpu"), torch.float32)
    assert (
        head.midlayer.mlp.gate_proj.weight.shape
        == (48, target.args.hidden_size)
        != (target.args.intermediate_size, target.args.hidden_size)
    )
    head.save(tmp_path / "narrow")
    assert json.loads((tmp_path / "narrow" / "config.json").read_text())["intermediate_size"] == 48
    back = load_head(
        plan_draft(draft_config("eagle3", init="checkpoint", path=str(tmp_path / "narrow")), target.args),
        target,
        1,
        torch.device("cpu"),
        torch.float32,
    )
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())


def test_eagle3_checkpoint_round_trip(tmp_path):
    _, target = pair()
    path = saved_head(tmp_path, target)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 200
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {
        "fc.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    } <= keys
    assert not any(k.startswith("embed_tokens") for k in keys)  # shared with the target, not saved
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape[1] == 2 * target.args.hidden_size

    plan = plan_draft(draft_config("eagle3", init="checkpoint", path=str(path)), target.args)
    assert plan.aux.source == "checkpoint" and plan.aux.input_of == (1, 2, 3)
    head = load_head(plan, target, 0, torch.device("cpu"), torch.float32)
    original = Eagle3Head(cfg, 64)
    plan.checkpoint.load_into(original)
    for k, v in original.state_dict().items():
        assert torch.equal(head.state_dict()[k], v), k
    assert torch.equal(head.to_target(torch.tensor([0, 5, 199])), torch.tensor([0, 6, 265]))

    # A loaded head drafts (target ids through d2t) and the output stays the target's.
    target.set_aux_layers(plan.aux.input_of)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    draft = make_draft(plan, head, target, 2, 3)
    prompts = random_prompts(2)
    assert draft.embed.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()  # shared storage
    assert [r.tokens for r in Generator(target, 2, draft, 3).generate(prompts, params)] == [
        r.tokens for r in Generator(target, 2).generate(prompts, params)
    ]


def test_fc_width_mismatch_fails_at_plan_time_with_both_numbers(tmp_path, outputs):
    _, target = pair()
    path = saved_head(tmp_path, target, aux_output_of=(0, 1, 2))  # fc takes 3 x 64 = 192
    cfg = to_run_config(
        compose_cfg(
            *TINY,
            "draft=eagle3",
            "draft.init=checkpoint",
            f"draft.path={path}",
            "draft.aux_layer_ids=[1,3]",
            "model.random.num_hidden_layers=3",
        )
    )
    with pytest.raises(PlanError) as e:
        build_plan(cfg, outputs)
    text = str(e.value)
    assert "fc.weight takes 192 inputs" in text and "128" in text and "2 aux layers x target hidden 64" in text


def test_wrong_architecture_and_missing_checkpoint(tmp_path, outputs):
    _, target = pair()
    path = saved_head(tmp_path, target)
    for overrides, needle in [
        (["draft=eagle", "draft.init=checkpoint", f"draft.path={path}"], "LlamaForCausalLMEagle3"),
        (["draft=eagle3", "draft.init=checkpoint", f"draft.path={tmp_path}/none"], "not a draft checkpoint"),
        (["draft=eagle3", "draft.init=checkpoint", "draft.path=null"], "draft.path=None"),
        (["draft=eagle3", "draft.num_steps=0", "draft.aux_layer_ids=[1,2]"], "draft.num_steps=0"),
        (["draft=eagle3", "draft.init=random"], "is not valid for a 4-layer target"),  # [2, 2, 1] on 4 layers
        (["draft=eagle3"], "target_hidden_size 576 differs"),  # the shipped SmolLM2 head on a tiny target
        (["draft=oracle", "eval.baseline=false"], "eval.baseline=False"),
    ]:
        with pytest.raises(PlanError) as e:
            build_plan(to_run_config(compose_cfg(*TINY, *overrides)), outputs)
        assert needle in str(e.value), (overrides, str(e.value))


# ------------------------------------------------------------------------------------------ pipeline
# ------------------------------------------------------------------------------------------ the registry
# The weighted drafts and the aux layer ids each reads (None: the target's final hidden state).
WEIGHTED = {"eagle3": [1, 2, 3], "eagle": None, "multi_layer_eagle": None, "dflash": [1, 2, 3]}


def test_every_weighted_draft_builds_a_head_of_the_protocol_with_a_trainer():
    """Each folder's record, through the table: the head built from its plan implements DraftHead (the
    EAGLE family's also FeatureHead, the one-step program its loop chains), and it names how it trains
    and the recipe the random-weights warning points to."""
    assert {name for name, a in DRAFTS.items() if a.head is not None} == set(WEIGHTED)
    _, target = pair()
    for name, ids in WEIGHTED.items():
        aux = {"aux_layer_ids": ids} if ids is not None else {}  # the drafts that read aux layers
        plan = plan_draft(draft_config(name, init="random", **aux), target.args)
        head = load_head(plan, target, 0, torch.device("cpu"), torch.float32)
        assert type(head) is plan.spec.head and isinstance(head, DraftHead), name
        assert isinstance(head, FeatureHead) == (plan.spec.make is make_feature), name
        assert plan.spec.train is not None and plan.spec.recipe in plan.random_weights_warning(), name
        assert plan.describe().startswith(f"{name}, RANDOM-WEIGHT head"), plan.describe()


def test_an_unknown_algorithm_is_one_error_naming_every_registered_one():
    with pytest.raises(ConfigError) as e:
        algorithm("eagle4")
    assert e.value.key == "draft.algorithm" and e.value.value == "eagle4"
    assert all(name in str(e.value) for name in ALGORITHMS)


def test_eagle3_job_is_tracked_with_draft_metrics(outputs, capsys):
    ctx = run(
        compose_cfg(
            "+experiment=eagle3",
            *TINY,
            "draft.init=random",
            "draft.aux_layer_ids=[1,2,3]",
            "draft.num_steps=2",
            "eval.batch_size=2",
        )
    )
    summary = capsys.readouterr().out  # the end-of-run table says the head is random, and what to run instead
    assert "eagle3 k=2 (random weights)" in summary and "WARNING: the eagle3 head has RANDOM WEIGHTS" in summary
    assert "+experiment=train_eagle3_smollm2" in summary
    m = ctx["eval_results"]["metrics"]
    assert m["match_baseline"] == 1.0 and 1.0 <= m["accept_length"] <= 3.0
    (r,) = runs_of(outputs, "eagle3")
    assert r.info.status == "FINISHED"
    for key in (
        "accept_length",
        "accept_rate_pos_0",
        "accept_rate_pos_1",
        "draft_ms",
        "verify_ms",
        "tokens_per_s",
        "baseline_tokens_per_s",
        "speedup",
        "match_baseline",
    ):
        assert key in r.data.metrics, key
    assert r.data.params["aux_layer_ids.input_of"] == "[1, 2, 3]"
    assert r.data.params["aux_layer_ids.output_of"] == "[0, 1, 2]"
    assert r.data.params["aux_layer_ids.source"] == "config"
    assert r.data.params["model.pdl.on"] == "False"  # resolved: no dependent launches on a CPU
    line = json.loads(download_text(outputs, r.info.run_id, "results.jsonl").splitlines()[0])
    assert line["accept_length"] >= 1.0


def test_oracle_job_reaches_full_acceptance(outputs):
    ctx = run(
        compose_cfg(
            "+experiment=oracle",
            "model=tiny",
            "eval.limit=2",
            "eval.max_new_tokens=13",
            "eval.ignore_eos=true",
            "device=cpu",
            "tracking=off",
        )
    )  # 1 + 3 rounds of 4
    m = ctx["eval_results"]["metrics"]
    assert m["accept_length"] == 4.0 and m["accept_rate_pos_2"] == 1.0 and m["match_baseline"] == 1.0


def test_input_embeds_prompts_through_eval(tmp_path, outputs):
    """question.jsonl with placeholder ids + an embeddings file: the same output as the real ids."""
    from engine.loading import load_model

    cfg = to_run_config(compose_cfg(*TINY))
    target = load_model(cfg.model, outputs / "weights", torch.device("cpu"), torch.float32).model
    real = [[256, 72, 105, 33, 10, 60], [256, 84, 104, 101, 32, 99, 97, 116]]
    rows = []
    for i, ids in enumerate(real):
        torch.save(target.model.embed_tokens(torch.tensor(ids)).detach(), tmp_path / f"e{i}.pt")
        rows.append({"question_id": f"real{i}", "prompt_token_ids": ids})
        rows.append({"question_id": f"mm{i}", "prompt_token_ids": [0] * len(ids), "input_embeds": f"e{i}.pt"})
    qs = tmp_path / "question.jsonl"
    qs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = run(
        compose_cfg(
            *TINY,
            f"eval.dataset={qs}",
            "eval.limit=4",
            "+experiment=eagle3",
            "draft.init=random",
            "draft.aux_layer_ids=[1,2,3]",
            "tracking=off",
        )
    )
    toks = {r.prompt.id: r.result.tokens for r in ctx["eval_results"]["records"]}
    assert toks["mm0"] == toks["real0"] and toks["mm1"] == toks["real1"]
