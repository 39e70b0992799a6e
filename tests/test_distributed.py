"""Data-parallel draft training under torchrun (engine/train/distributed.py): two CPU processes on the gloo
backend train the head a single process trains on the same data, with one MLflow run and one head."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.models import synth, tiny_target
from helpers.runs import compose_cfg, metric_history
from helpers.train import EAGLE3_TRAIN as TRAIN
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from pipeline.__main__ import run
from pipeline.config import to_run_config
from pipeline.paths import REPO
from pipeline.plan import PlanError, build_plan
from pipeline.tracking import default_tracking_uri

# several batches an epoch (max_tokens 256 of rows up to 64 wide), some of an odd number of samples: the
# ranks' parts differ in size and in trained tokens; an evaluation mid-run (rank 0 alone), the recipe's EMA,
# and a time budget (rank 0's clock, broadcast every step) too long to reach: the recipe's 600 s would let
# the LR schedule follow each run's own wall time, which differs between the runs
DDP = [
    *TRAIN,
    "train.steps=20",
    "train.max_tokens=256",
    "train.eval_every=10",
    "train.save_every=10",
    "train.max_time_s=1e9",
]


def _torchrun(nproc: int, *overrides: str, outputs) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECPIPE_OUTPUTS": str(outputs)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(
        [*cmd, "-m", "pipeline", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_two_ranks_train_the_head_one_process_trains_on_the_same_data(outputs):
    two_ranks_equal_one_process(outputs, "cpu", rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_over_nccl_train_the_head_one_gpu_trains_on_the_same_data(outputs):
    """The same on two GPUs: NCCL beside the target's CUDA graphs; float32, so only the all-reduce's order
    and the kernels' own rounding part the runs."""
    two_ranks_equal_one_process(outputs, "cuda", rtol=1e-3, atol=1e-4, acc_atol=0.02, weights_rel=1e-2)


def two_ranks_equal_one_process(
    outputs, device: str, rtol: float, atol: float, acc_atol: float = 0.0, weights_rel: float | None = None
) -> None:
    """acc_atol: how far the logged accuracies may differ (a share of tokens: where the summed gradients
    differ in their last bits, a near tie between two tokens may go the other way). weights_rel: compare
    each weight by its relative distance instead of elementwise (AdamW moves a weight whose gradient is
    near zero by a whole step either way, so a few elements may part by lr while the rest agree)."""
    ddp = [*DDP, f"device={device}"]
    p = _torchrun(2, *ddp, outputs=outputs)
    assert p.returncode == 0, p.stderr[-3000:]
    # rank 1 is quiet: one plan, one load, one summary
    assert p.stdout.count("experiment: train_eagle3_smollm2") == 1 and p.stdout.count("[load]") == 1
    assert p.stdout.count("[train_draft] 20 steps") == 1

    # the ranks' shards joined into one data set of the size asked for; the shards are gone
    (data,) = (outputs / "train" / "data").iterdir()
    assert len((data / "samples.jsonl").read_text().splitlines()) == 16 and not (data / "shards").exists()
    # one head, one MLflow run: rank 0's, finished
    trained = outputs / "train" / "train_eagle3_smollm2"
    assert json.loads((trained / "head" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    client = MlflowClient(default_tracking_uri(outputs))
    exp = client.get_experiment_by_name("train_eagle3_smollm2")
    (two,) = client.search_runs([exp.experiment_id])
    assert two.info.status == "FINISHED" and two.data.metrics["train_steps"] == 20
    assert two.data.metrics["data_reused"] == 0.0

    # one process on the same data (the cache is keyed by the data settings, not the ranks)
    run(compose_cfg(*ddp, "train.name=one"))
    (one,) = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_id != two.info.run_id]
    assert one.data.metrics["data_reused"] == 1.0
    # the same training: the logged losses and the raw weights (checkpoint/, float32) agree to rounding
    for key in ("train_loss", "train_acc_0", "val_loss"):
        a, b = metric_history(client, two.info.run_id, key), metric_history(client, one.info.run_id, key)
        assert [s for s, _ in a] == [s for s, _ in b] and len(a) >= 2
        tol = dict(rel=rtol, abs=max(atol, acc_atol if "acc" in key else 0.0))
        assert [v for _, v in a] == pytest.approx([v for _, v in b], **tol), key
    val = metric_history(client, two.info.run_id, "val_loss")
    assert val[-1][1] < val[0][1]  # it trained
    heads = [load_file(str(d / "checkpoint" / "model.safetensors")) for d in (trained, trained.parent / "one")]
    assert heads[0].keys() == heads[1].keys()
    for name, w in heads[0].items():
        if weights_rel is None or not w.is_floating_point():  # d2t/t2d: integers, equal
            torch.testing.assert_close(w, heads[1][name], atol=atol, rtol=rtol, msg=name)
        else:
            assert (w - heads[1][name]).norm() <= weights_rel * heads[1][name].norm(), name


def test_sharded_synthesis_draws_disjoint_slices_of_the_one_process_seeds(outputs):
    """Rank r of n takes generation batches r, r + n, ...: two ranks' samples together are one process's
    (when no message is drawn again)."""
    target = tiny_target(outputs)
    kw = dict(batch_size=2, max_prompt_tokens=8, max_answer_tokens=6, seed=3, min_prompt_chars=1)
    whole = synth(target, n=6, **kw)
    parts = [synth(target, n=n, shard=(r, 2), **kw) for r, n in ((0, 4), (1, 2))]
    batch = [whole[i : i + 2] for i in range(0, 6, 2)]  # one process: batches 0, 1, 2
    assert [s.ids for s in parts[0]] == [s.ids for s in batch[0] + batch[2]]
    assert [s.ids for s in parts[1]] == [s.ids for s in batch[1]]


def test_torchrun_for_a_task_other_than_train_draft_is_one_clear_error(outputs, monkeypatch):
    for key, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    with pytest.raises(PlanError, match=r"task='eval'.*only train_draft trains data-parallel"):
        build_plan(to_run_config(compose_cfg("+experiment=baseline", "model=tiny", "device=cpu")))
    build_plan(to_run_config(compose_cfg(*DDP, "device=cpu")))  # the training plan is fine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_more_processes_than_gpus_is_one_clear_error(outputs, monkeypatch):
    n = torch.cuda.device_count()
    for key, value in (("WORLD_SIZE", n + 1), ("RANK", 0), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", n + 1)):
        monkeypatch.setenv(key, str(value))
    with pytest.raises(PlanError, match=rf"device='cuda'.*{n + 1} processes.*nproc_per_node<={n}"):
        build_plan(to_run_config(compose_cfg(*TRAIN, "device=cuda")))
    monkeypatch.setenv("LOCAL_RANK", str(n - 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(n))
    assert build_plan(to_run_config(compose_cfg(*TRAIN, "device=cuda"))).env.device == torch.device("cuda", n - 1)
