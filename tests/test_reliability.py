"""Reliability: what a run does with input it cannot serve, where it writes, and how it stops.

Plan time: a prompt that does not fit the KV cache with eval.max_new_tokens and the draft's tokens fails
the plan through the tokenizer alone (no weights), with the other bad values, exit 2 and no MLflow run.
Hydra's run directories follow SPECPIPE_OUTPUTS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg

from engine.tokenizer import ByteTokenizer
from pipeline.config import to_run_config
from pipeline.paths import REPO
from pipeline.plan import PlanError, build_plan

TINY = ("model=tiny", "device=cpu", "model.max_seq_len=128", "eval.max_new_tokens=16")


def question_jsonl(path: Path, turns: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question_id": 100 + i, "turns": [t]}) + "\n" for i, t in enumerate(turns)))
    return path


def test_a_prompt_beyond_the_kv_cache_fails_the_plan_naming_its_record(tmp_path, outputs):
    long_ = "why is the sky blue? " * 5  # about 124 tokens: beyond 128 slots with 16 new tokens and 3 drafted
    data = question_jsonl(tmp_path / "question.jsonl", ["short one", long_, "another short one"])
    tokens = len(ByteTokenizer().encode_chat(long_))  # the tiny model's tokenizer, chat template on
    cfg = to_run_config(compose_cfg(*TINY, f"eval.dataset={data}", "draft=ngram", "draft.num_steps=3"))
    with pytest.raises(PlanError) as err:
        build_plan(cfg, outputs)
    text = str(err.value)
    assert f"eval.dataset='{data}'" in text and "record 2 (question_id '101')" in text, text
    assert f"has {tokens} prompt tokens" in text and "draft.num_steps=3" in text, text
    assert f"= {tokens + 16 + 3} KV slots, beyond model.max_seq_len=128" in text, text
    assert f"eval.max_new_tokens <= {128 - tokens - 3}" in text and f"model.max_seq_len >= {tokens + 19}" in text
    # the same prompts fit once the cache holds them, and the short records alone fit as they are
    build_plan(to_run_config(compose_cfg(*TINY, f"eval.dataset={data}", f"model.max_seq_len={tokens + 19}")), outputs)
    build_plan(to_run_config(compose_cfg(*TINY, f"eval.dataset={data}", "eval.limit=1")), outputs)


def test_prompt_lengths_are_reported_with_the_other_plan_errors_exit_2_and_no_run(tmp_path, outputs):
    data = question_jsonl(tmp_path / "question.jsonl", ["x" * 200])
    run = subprocess.run(
        [sys.executable, "-m", "pipeline", *TINY, f"eval.dataset={data}", "eval.batch_size=0", "tracking=mlflow"],
        cwd=REPO,
        env={**os.environ, "SPECPIPE_OUTPUTS": str(outputs)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    err = run.stderr + run.stdout
    assert "eval.batch_size=0" in err and "record 1 (question_id '100')" in err, err[-2000:]
    assert "Traceback" not in err
    assert not (outputs / "mlflow.db").exists() or _run_count(outputs) == 0


def _run_count(outputs: Path) -> int:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")
    return sum(len(c.search_runs([e.experiment_id])) for e in c.search_experiments())


def test_hydra_run_directories_follow_specpipe_outputs(tmp_path):
    """A run under SPECPIPE_OUTPUTS writes its Hydra directory there; nothing under the repository's outputs/."""
    marker = f"outputs_follow_{os.getpid()}_{tmp_path.name}"  # finds this run's directory wherever it went
    out = tmp_path / "elsewhere"
    run = subprocess.run(
        [sys.executable, "-m", "pipeline", "model=tiny", "device=cpu", "dry_run=true", f"experiment_name={marker}"],
        cwd=REPO,
        env={**os.environ, "SPECPIPE_OUTPUTS": str(out)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    mine = [p for p in out.glob("runs/*/*/.hydra/overrides.yaml") if marker in p.read_text()]
    assert len(mine) == 1, sorted(out.rglob("*"))
    in_repo = [p for p in (REPO / "outputs").glob("*/*/*/.hydra/overrides.yaml") if marker in p.read_text()]
    assert in_repo == []
