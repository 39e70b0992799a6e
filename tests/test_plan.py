"""Plan validation: every bad input is one clear message naming the key, the value and what is valid."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.runs import compose_cfg

from pipeline.config import to_run_config
from pipeline.plan import PlanError, build_plan


def plan_of(*overrides, outputs=None):
    return build_plan(to_run_config(compose_cfg(*overrides)), outputs)


def plan_error(*overrides, outputs=None) -> str:
    with pytest.raises(PlanError) as e:
        plan_of(*overrides, outputs=outputs)
    return str(e.value)


def test_valid_plan_and_its_description(outputs):
    plan = plan_of("model=tiny", "eval.batch_size=2", "device=cpu", outputs=outputs)
    assert plan.names == ["load", "eval"]
    text = plan.describe()
    for needle in [
        "1. load",
        "2. eval",
        "requires [target, draft_head]",
        "4 layers, hidden 64",
        "cpu (float32)",
        "KV cache",
    ]:
        assert needle in text
    mem = plan.memory_estimate()
    # tiny: 4 layers x 2 kv heads x 16 dims x 2 (k, v) x 4 bytes x 2049 slots x batch 2
    assert mem["kv_cache_mb"] == pytest.approx(4 * 2 * 16 * 2 * 4 * 2049 * 2 / 2**20)


EAGLE3 = ("draft.init=random", "draft.aux_layer_ids=[1,2,3]")


@pytest.mark.parametrize(
    "overrides, runners",
    [
        (("+experiment=eagle3_bcg", "eval.batch_size=3", "eval.temperature=0.7", *EAGLE3), 3),  # greedy, sampled
        (("+experiment=serve_eagle3_bcg", "serve.max_batch_size=3", *EAGLE3), 3),  # a server: one staging row
        (("+experiment=eagle3_bcg", "eval.batch_size=2", "draft=none"), 1),  # the target's alone
        (
            (
                "+experiment=serve_eagle3_bcg",
                "serve.max_batch_size=2",
                "draft=dflash",
                *EAGLE3,
                "draft.block_size=4",
                "draft.num_steps=3",
            ),
            2,
        ),
    ],
)
def test_the_memory_estimate_counts_the_caches_and_prefill_inputs_as_capture_allocates_them(
    outputs, overrides, runners
):
    """The plan's KV caches (the target's and the draft head's, with a server's staging rows) and
    `prefill_buffers_mb` are the bytes that capture_graphs allocates (the debug policy allocates them on
    a CPU as a GPU policy does); a draft's greedy and sampled prefill runners share their inputs."""
    plan = plan_of(
        *overrides,
        "model=tiny",
        "device=cpu",
        "graph=debug",
        "graph.prefill_buckets=[16,64]",
        outputs=outputs,
    )
    graphs = plan.set_up("load", "configure_aux_capture", "capture_graphs")["graphs"]
    prefill = [r for name, r in graphs.runners.items() if "prefill" in name]
    buffers = {b.data_ptr(): b.numel() * b.element_size() for r in prefill for b in r.buffers.values()}
    assert len(prefill) == runners
    mem = plan.memory_estimate()
    assert mem["prefill_buffers_mb"] * 2**20 == pytest.approx(sum(buffers.values()))
    target = [graphs.cache] + ([graphs.prefill_cache] if graphs.prefill_cache is not graphs.cache else [])
    assert mem["kv_cache_mb"] * 2**20 == pytest.approx(sum(c.nbytes() for c in target))
    draft = [] if graphs.draft is None else [graphs.draft.cache]
    draft += [graphs.draft_prefill_cache] if draft and graphs.draft_prefill_cache is not draft[0] else []
    assert mem["draft_kv_cache_mb"] * 2**20 == pytest.approx(sum(c.nbytes() for c in draft))


def test_the_memory_estimate_skips_prefill_buckets_past_max_seq_len(outputs):
    """A bucket longer than model.max_seq_len is never captured, so it adds no activations: the estimate
    with buckets [16, 64, 4096] at 400 slots is that of [16, 64], and below that of 4096 slots."""
    common = ("model=tiny", "device=cpu", "graph=debug", "eval=quick", "eval.batch_size=2", "eval.max_new_tokens=32")
    mem = lambda *o: plan_of(*common, *o, outputs=outputs).memory_estimate()["activations_mb"]  # noqa: E731
    fits = mem("model.max_seq_len=400", "graph.prefill_buckets=[16,64]")
    assert mem("model.max_seq_len=400", "graph.prefill_buckets=[16,64,4096]") == fits
    assert mem("model.max_seq_len=4096", "graph.prefill_buckets=[16,64,4096]") > fits


def test_set_up_runs_only_the_stages_named(outputs):
    """A script's way to the loaded target and head (benchmarks/): those stages' outputs, no eval."""
    plan = plan_of(
        "+experiment=eagle3",
        "model=tiny",
        "draft.init=random",
        "draft.aux_layer_ids=[1,2,3]",
        "device=cpu",
        outputs=outputs,
    )
    assert plan.names == ["load", "configure_aux_capture", "eval"]
    ctx = plan.set_up("load", "configure_aux_capture")
    assert set(ctx) == {"target", "draft_head", "aux_layers"} and ctx["target"].model.args.num_layers == 4
    assert set(plan.set_up("load")) == {"target", "draft_head"}


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["task=serving"], ["task='serving'", "eval, serve, train_draft"]),
        (
            ["draft.algorithm=eagle9"],
            ["draft.algorithm='eagle9'", "none, eagle3, eagle, multi_layer_eagle, ngram, oracle, dflash"],
        ),
        (["graph.policy=fullest"], ["graph.policy='fullest'", "none"]),
        (["eval.dataset=nope_bench"], ["eval.dataset='nope_bench'", "humaneval", "mt_bench"]),
        (["eval.limit=0"], ["eval.limit=0", ">= 1"]),
        (["eval.top_p=1.5"], ["eval.top_p=1.5", "(0, 1]"]),
        (["eval.temperature=-1"], ["eval.temperature=-1.0", ">= 0"]),
        (["eval.peers=[vllm]"], ["eval.peers='vllm'", "hf_generate"]),
        (["draft=eagle", "draft.algorithm=eagle3"], ["draft.algorithm='eagle3'", "EagleConfig's", "draft=eagle3"]),
        (["eval.peers=[torch_compile]", "eval.temperature=0.7"], ["eval.peers='torch_compile'", "eval.temperature=0"]),
        (["eval.max_new_tokens=4096"], ["eval.max_new_tokens=4096", "model.max_seq_len=2048"]),
        (["model.source=onnx"], ["model.source='onnx'", "gguf, hf, random"]),
        (["model.random.vocab_size=100"], ["model.random.vocab_size=100", ">= 259"]),
        (["model.random.model_type=gemma"], ["model.random.model_type='gemma': unknown", "llama", "qwen3"]),
    ],
)
def test_bad_values_are_named(overrides, needles, outputs):
    text = plan_error("model=tiny", *overrides, outputs=outputs)
    for n in needles:
        assert n in text, text


@pytest.mark.parametrize(
    "overrides, needles",
    [
        # a key the chosen draft does not have: draft=<name>'s schema is its dataclass (engine/drafts)
        (["draft=ngram", "draft.block_size=8"], ["draft.block_size='8': no such key", "draft.ngram_max"]),
        (
            ["draft=eagle", "draft.init=random", "draft.aux_layer_ids=[1,2]"],
            ["draft.aux_layer_ids='[1,2]': no such key", "draft.init_seed"],
        ),
        (["draft=dflash", "draft.num_stepz=4"], ["draft.num_stepz='4': no such key", "draft.num_steps"]),
        # a value of the wrong type for that schema
        (["draft=ngram", "draft.ngram_max=three"], ["draft.ngram_max='three': wrong type", "Integer"]),
        (["draft=dflash", "draft.block_size=[8]"], ["draft.block_size='[8]': wrong type"]),
    ],
)
def test_a_draft_key_its_option_lacks_is_hydra_s_error_in_one_line(overrides, needles):
    """Hydra composes draft=<name> over its algorithm's schema: a key outside it, or a value of another type,
    fails composition, reported as the pipeline's one line (key, value, what is valid) before any load."""
    from pipeline.compose_check import compose_problems

    errors, _ = compose_problems(["model=tiny", "device=cpu", *overrides])
    assert len(errors) == 1, errors
    for n in needles:
        assert n in str(errors[0]), errors[0]


def test_a_draft_key_added_with_a_plus_is_still_unknown():
    """`+draft.key=value` slips past Hydra's struct mode; the conversion to the run config names it, with
    the keys of the chosen algorithm."""
    from engine.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        to_run_config(compose_cfg("model=tiny", "draft=ngram", "+draft.init=random"))
    assert "draft.init='random': unknown key" in str(e.value) and "ngram_max" in str(e.value)


def test_all_problems_reported_at_once(outputs):
    text = plan_error("model=tiny", "draft.algorithm=x", "graph.policy=y", outputs=outputs)
    assert "draft.algorithm='x'" in text and "graph.policy='y'" in text


def test_missing_model_file(outputs):
    text = plan_error("model.path=/nonexistent/model.gguf", outputs=outputs)
    assert "model.path='/nonexistent/model.gguf'" in text and "no such file" in text


def test_file_that_is_not_gguf(tmp_path, outputs):
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    assert "not a GGUF file" in plan_error(f"model.path={bogus}", outputs=outputs)


def test_directory_that_is_not_a_checkpoint(tmp_path, outputs):
    assert "not a checkpoint: no config.json" in plan_error("model=hf", f"model.path={tmp_path}", outputs=outputs)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "no *.safetensors" in plan_error("model=hf", f"model.path={tmp_path}", outputs=outputs)


def test_non_llama_checkpoint(tmp_path, outputs):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert "model_type 't5'" in plan_error("model=hf", f"model.path={tmp_path}", outputs=outputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cuda_requested_without_cuda(outputs):
    text = plan_error("model=tiny", "device=cuda", outputs=outputs)
    assert "device='cuda'" in text and "CUDA is not available" in text and "cpu" in text


def test_requires_chain_is_checked(outputs, monkeypatch):
    import pipeline.plan as plan_mod

    monkeypatch.setattr(plan_mod, "resolve_stage_names", lambda cfg, draft: ["eval", "load"])
    text = plan_error("model=tiny", outputs=outputs)
    assert "stages='eval'" in text and "requires ['target', 'draft_head']" in text
