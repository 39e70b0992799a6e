"""Shared fixtures: composing configs as a user types them, an isolated outputs dir, tiny HF models."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hydra import compose, initialize
from omegaconf import DictConfig

from pipeline.config import register_configs
from pipeline.paths import REPO

register_configs()


def cli(
    *args: str, outputs: Path, module: str = "pipeline", timeout: int = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m <module> *args` from the repository, as a user types it, writing under `outputs`
    (SPECPIPE_OUTPUTS; `env`: more variables); its exit code and output to assert on."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**os.environ, "SPECPIPE_OUTPUTS": str(outputs), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def benchmark_module(name: str):
    """benchmarks/<name>.py imported by path (the folder is no package and stays off sys.path)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def parent_and_children(outputs: Path, experiment: str):
    """A sweep's MLflow runs in the store under `outputs`: (its one parent, its children in job order);
    every run of the experiment is one of them, and every child names that parent."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name(experiment).experiment_id])
    (parent,) = [r for r in runs if "sweep.overrides" in r.data.tags]
    children = sorted((r for r in runs if "mlflow.parentRunId" in r.data.tags), key=lambda r: r.data.tags["sweep.job"])
    assert len(runs) == 1 + len(children)
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    return parent, children


# The quick tier (`python -m pytest -q -m quick`, about 2 minutes on 2 CPU cores): the fast modules whole and
# a few end-to-end tests of each area, for a first look after a change; the CPU suite (`-m "not gpu"`) is the gate.
QUICK: dict[str, set[str] | None] = {  # module -> its test functions in the tier (None: all of them)
    "test_config.py": None,
    "test_plan.py": None,
    "test_model.py": None,
    "test_layers.py": None,
    "test_decoder.py": None,
    "test_speculative.py": None,
    "test_drafts.py": None,
    "test_graphs.py": None,
    "test_train_data.py": None,
    "test_storage.py": None,
    "test_gemv.py": {"test_matches_reference"},
    "test_kernels.py": {"test_decode_attention_row_is_independent_of_batch_and_t"},
    "test_pipeline.py": {"test_tiny_eval_run_is_tracked", "test_cli_bad_input_is_one_clear_error"},
    "test_compare.py": {"test_compare_across_experiments_writes_csv_markdown_and_chart"},
    "test_serve.py": {"test_served_outputs_equal_eval_sequential_and_concurrent"},
    "test_train_draft.py": {"test_train_draft_stage_trains_exports_resumes_and_drafts"},
    "test_first_contact.py": {
        "test_a_ratio_comes_with_its_per_batch_spread_and_the_digits_it_supports",
        "test_the_passes_alternate_by_batch_and_a_load_on_one_of_them_is_reported",
        "test_a_cuda_plan_is_validated_and_printed_on_a_host_without_cuda",
        "test_a_run_folder_holds_the_plan_progress_and_summary",
        "test_help_says_what_the_tool_is_and_lists_every_group_and_experiment",
        "test_the_key_reference_is_current",
        "test_self_distillation_on_a_target_that_repeats_one_token_warns",
    },
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        tests = QUICK.get(item.path.name, set())
        if tests is None or item.originalname in tests:
            item.add_marker(pytest.mark.quick)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def compose_cfg(*overrides: str) -> DictConfig:
    with initialize(version_base="1.3", config_path="../conf"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(scope="session")
def mlflow_store_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store made as a run makes one (MlflowClient on its URI): its tables and
    migrations, 2-4 s per store, are created once for the session and copied into each test's outputs."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def outputs(tmp_path, monkeypatch, request) -> Path:
    """A fresh outputs/ (an empty MLflow store, artifacts) per test; converted weights shared with the repo's
    cache. Tests marked `fresh_store` get no store (they check that a run creates one, or that none is)."""
    out = tmp_path / "outputs"
    out.mkdir()
    shared = REPO / "outputs" / "weights"
    shared.mkdir(parents=True, exist_ok=True)
    (out / "weights").symlink_to(shared, target_is_directory=True)
    if "fresh_store" not in request.keywords:
        shutil.copyfile(request.getfixturevalue("mlflow_store_template"), out / "mlflow.db")
    monkeypatch.setenv("SPECPIPE_OUTPUTS", str(out))
    return out


def tiny_hf_config(**kw):
    from transformers import LlamaConfig

    base = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        bos_token_id=256,
        eos_token_id=257,
    )
    base.update(kw)
    return LlamaConfig(**base)


def spread_init(model: torch.nn.Module, seed: int = 0, std: float = 0.15) -> torch.nn.Module:
    """Weights wide enough that greedy outputs vary from token to token (std 0.02 collapses to one token)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def assert_trained_beats_random(
    outputs: Path, tmp_path: Path, common: list[str], trained: list[str], random_: list[str]
) -> None:
    """On the prompts the training synthesized (a question.jsonl written from the shared samples), a
    trained head drafts clearly better than a random one through the real loop, and both keep greedy
    output the target's. `common`: overrides for both evals, then each one's own."""
    import json

    from pipeline.__main__ import run

    (data,) = (outputs / "train" / "data").glob("*/samples.jsonl")
    qfile = tmp_path / "question.jsonl"
    qfile.write_text(
        "".join(
            json.dumps({"question_id": i, "turns": [json.loads(line)["user"]]}) + "\n"
            for i, line in enumerate(open(data))
        )
    )
    both = [*common, f"eval.dataset={qfile}", "tracking=off"]
    good, bad = (run(compose_cfg(*both, *own))["eval_results"]["metrics"] for own in (trained, random_))
    assert good["match_baseline"] == 1.0 and bad["match_baseline"] == 1.0
    assert good["accept_length"] > bad["accept_length"] + 0.2, (good["accept_length"], bad["accept_length"])


def assert_triton_ops_match_torch_ops(forward, head, batch, steps: int, trained: set[str]) -> None:
    """A training forward with the Triton norms and RoPE (train.kernels=triton) gives the torch ops'
    logits and, through the loss's backward, their gradients (fp32); the `trained` parameters get one."""
    from engine.drafts.common.ttt import TORCH_OPS, TRITON_OPS
    from engine.drafts.train_contract import ttt_loss

    head.requires_grad_(True)
    out = {}
    for ops in (TORCH_OPS, TRITON_OPS):
        logits = forward(head, batch, steps, ops=ops)
        head.zero_grad()
        ttt_loss(logits, batch)[0].backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        out[ops] = ([lg.detach() for lg in logits], grads)
    (l0, g0), (l1, g1) = out[TORCH_OPS], out[TRITON_OPS]
    for a, b in zip(l0, l1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert g0.keys() == g1.keys() and trained <= g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-3, msg=n)


# A draft training run on the tiny target in seconds (16 self-distilled samples, short sequences); each
# test adds its recipe (+experiment=train_<draft>_smollm2) and its steps, TTT steps and cadence.
TINY_TRAIN = [
    "model=tiny",
    "model.random.init_std=0.15",
    "train.data.num_samples=16",
    "train.data.batch_size=8",
    "train.data.max_prompt_tokens=12",
    "train.data.max_answer_tokens=24",
    "train.data.min_prompt_chars=1",
    "train.heldout=0.25",
    "train.warmup_steps=5",
    "train.max_tokens=1024",
    "train.max_len=64",
]


def tiny_train(recipe: str, k: int = 3, steps: int = 40) -> list[str]:
    """TINY_TRAIN for `+experiment=<recipe>` with k drafts (TTT steps and eval k alike), a short run
    that evaluates and saves every 20 steps, and the real loop's eval on 4 prompts."""
    return [
        f"+experiment={recipe}",
        *TINY_TRAIN,
        f"draft.num_steps={k}",
        "train.lr=5e-3",
        "train.eval_every=20",
        "train.save_every=20",
        f"train.ttt_steps={k}",
        f"train.eval_k={k}",
        f"train.steps={steps}",
        "train.loop_eval_prompts=4",
    ]
