"""CUDA behaviour (skipped without a GPU): the same model, runner and tracking on the device."""

from __future__ import annotations

import pytest
import torch
from helpers.models import hf_greedy, pair, random_prompts
from helpers.runs import compose_cfg

from engine.sampling import SamplingParams
from engine.speculative.generate import Generator
from pipeline.__main__ import run

pytestmark = pytest.mark.gpu


def test_cuda_fp32_logits_and_greedy_match_transformers():
    hf, ours = pair()
    hf, ours = hf.cuda(), ours.cuda()
    ours.init_buffers(torch.device("cuda"))
    ids = torch.randint(0, 320, (2, 33), device="cuda")
    with torch.no_grad():
        got = ours(ids, torch.arange(33, device="cuda").expand(2, 33), ours.new_cache(2), kv_len=33).logits
        assert (got - hf(ids).logits).abs().max().item() < 1e-4
    prompts = random_prompts(4)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    batched = [r.tokens for r in Generator(ours, 4).generate(prompts, params)]
    for p, got in zip(prompts, batched):
        assert got == hf_greedy(hf, p, 24)


def test_auto_device_picks_cuda_in_bf16(outputs):
    ctx = run(
        compose_cfg("model=tiny", "eval.limit=4", "eval.max_new_tokens=16", "eval.batch_size=2", "eval.ignore_eos=true")
    )
    m = ctx["eval_results"]["metrics"]
    target = ctx["target"].model
    assert target.lm_head.weight.is_cuda and target.lm_head.weight.dtype == torch.bfloat16
    assert target.rope_cos.dtype == torch.float32  # tables stay fp32 after the cast
    assert m["generated_tokens"] == 4 * 16
    assert m["peak_mem_mb"] > 0


@pytest.mark.slow
def test_smollm2_on_cuda_fp32_matches_transformers(outputs):
    ctx = run(
        compose_cfg(
            "+experiment=baseline",
            "eval.limit=4",
            "eval.max_new_tokens=32",
            "dtype=float32",
            "eval.batch_size=2",
            "eval.peers=[hf_generate]",
        )
    )
    assert ctx["eval_results"]["metrics"]["peer_match.hf_generate"] == 1.0


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle", "ngram", "oracle"])
def test_cuda_speculative_greedy_is_lossless(algorithm):
    from helpers.spec import build, run_all

    _, target = pair()
    target = target.cuda()
    target.init_buffers(torch.device("cuda"))
    prompts = random_prompts(4)
    params = SamplingParams(max_new_tokens=29, ignore_eos=True)
    base = [r.tokens for r in run_all(Generator(target, 4), prompts, params, 4)]
    gen = build(target, algorithm, 4, params, references=base, prompts=prompts)
    if gen.draft is not None and hasattr(gen.draft, "head"):
        assert gen.draft.head.fc.weight.is_cuda
    assert [r.tokens for r in run_all(gen, prompts, params, 4)] == base


def test_phase_clock_times_the_stream_without_waiting_for_it():
    """Marks are CUDA events: queuing a span never syncs (the stream is still busy after it), and the
    span read after a sync covers the work between its marks."""
    from engine.speculative.phase_clock import PhaseClock

    clock = PhaseClock(torch.device("cuda"))
    torch.cuda.synchronize()
    a = clock.mark()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock cycles
    b = clock.mark()
    clock.span("sleep", a, b)
    assert not torch.cuda.current_stream().query()  # nothing waited for the sleep
    assert clock.totals()["sleep"] > 0.02
    clock.span("again", clock.mark(), clock.mark())  # the settled events are recorded again
    assert len(clock._free) == 0 and clock.totals()["again"] >= 0.0


def test_a_job_leaves_nothing_on_the_device(outputs):
    """A sequential sweep runs its jobs in one process: after a job (graphs captured, draft head, caches) and
    the release `main` runs, none of its memory is held, so the next job has the whole device."""
    from pipeline.__main__ import release_device_memory

    release_device_memory()
    before, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()  # earlier tests' blocks too
    run(
        compose_cfg(
            "+experiment=eagle3_full",
            "model=tiny",
            "draft.init=random",
            "draft.aux_layer_ids=[1,2,3]",
            "eval=quick",
            "tracking=off",
        )
    )
    release_device_memory()
    assert torch.cuda.memory_allocated() == before
    assert torch.cuda.memory_reserved() - reserved < 64 << 20  # the graph pools went back to the driver


@pytest.mark.parametrize("policy", ["full", "bcg"])
def test_an_8b_shape_target_under_graphs_equals_the_debug_runner_at_every_batch_size(policy, outputs):
    """Llama-3.1-8B's widths (two of its 32 layers, random weights drawn on the GPU) under `policy` give the
    debug runner's tokens alone and in a batch of 4. (Alone and in a batch a prompt's tokens may part at
    these widths: its prefill runs on cuBLAS, whose kernel follows the row count. The decode and verify
    projections are batch-invariant, tests/test_gemv.py.)"""

    def tokens(graph: str, batch: int) -> list[list[int]]:
        ctx = run(
            compose_cfg(
                "+experiment=baseline",
                "model=llama3_8b_shape",
                "model.random.num_hidden_layers=2",
                "model.max_seq_len=512",
                f"graph={graph}",
                "eval=quick",
                "eval.max_new_tokens=12",
                "eval.ignore_eos=true",
                f"eval.batch_size={batch}",
                "tracking=off",
            )
        )
        return [r.result.tokens for r in ctx["eval_results"]["records"]]

    for batch in (1, 4):
        assert tokens(policy, batch) == tokens("debug", batch), batch
