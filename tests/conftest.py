"""Fixtures (an isolated outputs dir with its MLflow store) and the quick tier; the helpers the test modules
share are in tests/helpers/."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    # `-n N` workers share the cores: torch's default (a thread per core) in each would oversubscribe them;
    # the env var reaches the processes the tests start too
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
from pipeline.config import register_configs
from pipeline.paths import REPO


def _interpreted_dot_rounds_once() -> None:
    """Under the Triton interpreter, an fp32 tl.dot sums its products in fp64, rounds the sum to fp32 once,
    then adds the accumulator. The interpreter's own dot is numpy's fp32 matmul, which OpenBLAS rounds row
    by row according to where a row sits in the matrix under some of its kernels (OPENBLAS_CORETYPE=Haswell):
    the kernels' batch-invariance tests would read that host effect as theirs. On the GPU the dot is the
    kernel's own."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    plain = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.data.dtype == b.data.dtype == d.data.dtype == np.float32):  # the kernels' dots: fp32 here
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        ab = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return TensorHandle(ab.astype(np.float32) + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreted_dot_rounds_once()

register_configs()
pytest.register_assert_rewrite("helpers")  # their asserts report values, as the test modules' do


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
