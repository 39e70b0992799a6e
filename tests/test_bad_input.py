"""Every bad input before anything loads, all at once: one message naming each bad key or file, exit 2,
no run. Values of every phase together (composition, registries, device, draft, stages), files a user
can get wrong (prompt sets, embeddings, draft checkpoints, GGUF files, the MLflow store), and the memory
plan against the host.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
from helpers.runs import cli, compose_cfg
from safetensors.torch import load_file, save_file

from pipeline.config import to_run_config
from pipeline.plan import PlanError, available_memory, build_plan

TINY = ("model=tiny", "device=cpu")
SHIPPED = Path(__file__).resolve().parents[1] / "engine" / "drafts" / "checkpoints" / "smollm2-135m-instruct-eagle3"


def plan_errors(outputs: Path, *overrides: str) -> str:
    with pytest.raises(PlanError) as e:
        build_plan(to_run_config(compose_cfg(*overrides)), outputs)
    return str(e.value)


# ------------------------------------------------------------------------------------------ every phase
@pytest.mark.fresh_store
@pytest.mark.parametrize(
    "overrides, named",
    [
        (["eval.limt=2", "draft.num_stepz=3"], ["eval.limt='2': no such key", "draft.num_stepz='3': no such key"]),
        (
            ["graph.policy=nope", "draft=ngram", "draft.num_steps=0", "eval.batch_size=0"],
            ["graph.policy='nope'", "draft.num_steps=0", "eval.batch_size=0"],
        ),
        (["eval.limt=2", "eval.batch_size=0", "seed=-1"], ["eval.limt='2'", "eval.batch_size=0", "seed=-1"]),
        (
            [
                "draft=eagle3",
                "draft.init=random",
                "draft.aux_layer_ids=[1,2,3]",
                "draft.temperature_factor=-1",
                "eval.batch_size=0",
            ],
            ["draft.temperature_factor=-1.0", "eval.batch_size=0"],
        ),
    ],
)
def test_bad_values_of_every_phase_are_reported_together(outputs, overrides, named):
    run = cli(*TINY, *overrides, outputs=outputs, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert all(n in run.stderr for n in named), run.stderr[-2000:]
    assert "Traceback" not in run.stderr and not (outputs / "mlflow.db").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="device=cuda is valid here")
def test_a_device_error_does_not_hide_the_stage_errors(outputs):
    text = plan_errors(outputs, "model=tiny", "device=cuda", "eval.batch_size=0", "eval.temperature=inf")
    assert "device='cuda'" in text and "eval.batch_size=0" in text and "eval.temperature=inf" in text, text


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # cuda: planned on this host as on a GPU's
def test_a_bad_batch_under_graphs_is_named_by_its_own_key(outputs, device):
    text = plan_errors(outputs, "model=tiny", f"device={device}", "graph=full", "eval.batch_size=0")
    assert "eval.batch_size=0" in text and "capture_sizes" not in text, text
    text = plan_errors(outputs, "model=tiny", f"device={device}", "graph=full", "graph.max_batch_size=0")
    assert "graph.max_batch_size=0: out of range (valid: >= 1, or null for the run's batch)" in text, text


def test_a_training_recipe_names_its_bad_draft_value_and_every_bad_train_value(outputs):
    text = plan_errors(
        outputs,
        "+experiment=train_eagle3_smollm2",
        *TINY,
        "draft.aux_layer_ids=[1,2,3]",
        "draft.num_steps=0",
        "train.steps=0",
        "train.lr=-1",
        "train.ema_decay=1",
        "train.kernels=fused",
        "train.max_time_s=-1",  # trained one step and exported a head before
        "train.max_tokens=16",  # under the recipe's max_len: batches of one sequence, silently
        "train.weight_decay=-1",
        "train.loss_decay=-0.5",  # alternating signs over the steps, silently
        "train.loop_eval_tokens=0",
    )
    for key in (
        "draft.num_steps=0",
        "train.steps=0",
        "train.lr=-1.0",
        "train.ema_decay=1.0",
        "train.kernels='fused'",
        "train.weight_decay=-1.0",
        "train.loss_decay=-0.5",
        "train.loop_eval_tokens=0",
    ):
        assert key in text, text
    assert "train.max_time_s=-1.0: out of range (valid: > 0 seconds and finite, or null" in text, text
    assert "train.max_tokens=16: a batch of fewer padded tokens than one sequence of train.max_len=" in text, text


def test_a_run_folder_or_export_folder_a_user_got_wrong_is_named_before_training(outputs, tmp_path):
    from schema import REPO

    recipe = ("+experiment=train_eagle3_smollm2", *TINY)
    text = plan_errors(outputs, *recipe, "train.name=../../x", "train.heldout=nan", "train.lr=inf")
    assert "train.name='../../x': names the run's folder under <outputs>/train" in text, text
    assert "train.heldout=nan" in text and "train.lr=inf" in text, text
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "mine.txt").write_text("keep me")
    for where, problem in (
        (".", f"replacing it would delete {REPO.resolve()}"),
        (str(outputs.parent), f"replacing it would delete {outputs.resolve()}"),
        (str(folder), "not a draft head: it would be replaced"),
    ):
        text = plan_errors(outputs, *recipe, f"train.export_dir={where}")
        assert f"train.export_dir='{where}': {problem}" in text, text
    assert (folder / "mine.txt").read_text() == "keep me"


# ------------------------------------------------------------------------------------------ prompt files
def _record(**kw) -> str:
    return json.dumps({"question_id": 1, **kw})


@pytest.mark.parametrize(
    "content, problem",
    [
        (b'{"question_id": 1, "turns": ["caf\xe9"]}\n', "line 1 is not UTF-8"),
        (b"[1, 2]\n", "a JSON list, not an object"),
        (b'"a prompt"\n', "a JSON str, not an object"),
        (_record(prompt_token_ids=["1", "2"]).encode(), "token ids are integers"),
        (_record(prompt_token_ids=[[1], [2]]).encode(), "token ids are integers"),
        (_record(prompt_token_ids=[1.0, 2.5]).encode(), "token ids are integers"),
        (_record(prompt_token_ids=[]).encode(), "a non-empty list of integers"),
        (_record(prompt_token_ids=[1, 2], input_embeds="missing.pt").encode(), "no such file"),
    ],
)
def test_a_prompt_file_a_user_got_wrong_is_one_clear_error(outputs, tmp_path, content, problem):
    data = tmp_path / "question.jsonl"
    data.write_bytes(content)
    text = plan_errors(outputs, *TINY, f"eval.dataset={data}")
    assert f"eval.dataset='{data}'" in text and problem in text, text


def test_input_embeds_that_do_not_fit_are_named_at_plan_time(outputs, tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"not a tensor file")
    torch.save(torch.zeros(3, 7), tmp_path / "shape.pt")  # the tiny target's hidden is 64
    for name, problem in (
        ("garbage.pt", "garbage.pt does not load"),
        ("shape.pt", "holds a torch.float32 tensor [3, 7], not a float tensor [3, 64]"),
    ):
        data = tmp_path / "question.jsonl"
        data.write_text(_record(prompt_token_ids=[1, 2, 3], input_embeds=name) + "\n")
        text = plan_errors(outputs, *TINY, f"eval.dataset={data}")
        assert "question_id '1': input_embeds" in text and problem in text, text


# ------------------------------------------------------------------------------------------ draft checkpoints
def _broken_head(tmp_path: Path, config=None, tensors=None) -> Path:
    """The shipped EAGLE3 head (fp8 with scales) copied, with its config.json or tensors changed."""
    d = tmp_path / "head"
    shutil.copytree(SHIPPED, d)
    if config is not None:
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors is not None:
        state = tensors(load_file(d / "model.safetensors"))
        save_file(state, d / "model.safetensors")
    return d


def _cfg() -> dict:
    return json.loads((SHIPPED / "config.json").read_text())


@pytest.mark.parametrize(
    "config, tensors, problem",
    [
        ("{not json", None, "config.json is not JSON"),
        ("[1, 2]", None, "config.json holds a list, not an object"),
        ({k: v for k, v in _cfg().items() if k != "hidden_size"}, None, "does not describe a eagle3 head"),
        ({**_cfg(), "intermediate_size": "768"}, None, "does not describe a eagle3 head"),
        (None, lambda s: {**s, "extra.weight": torch.zeros(2)}, "unexpected extra.weight [2]"),
        (None, lambda s: {**s, "norm.weight": torch.ones(7)}, "norm.weight is [7], expected [576]"),
        (
            None,
            lambda s: {k: v for k, v in s.items() if k != "midlayer.mlp.down_proj.weight_scale"},
            "fp8 weights without their _scale tensor: ['midlayer.mlp.down_proj.weight']",
        ),
    ],
)
def test_a_draft_checkpoint_a_user_got_wrong_is_named_before_it_loads(outputs, tmp_path, config, tensors, problem):
    head = _broken_head(tmp_path, config, tensors)
    text = plan_errors(outputs, "+experiment=eagle3", "device=cpu", f"draft.path={head}")
    assert f"draft.path='{head}'" in text and problem in text, text


# ------------------------------------------------------------------------------------------ models, values
def test_model_values_and_files_a_user_got_wrong(outputs, tmp_path):
    from engine.loading import packaged_smollm2_gguf

    text = plan_errors(outputs, *TINY, "model.random.num_key_value_heads=0", "model.random.hidden_size=0")
    assert "model.random.num_key_value_heads=0" in text and "model.random.hidden_size=0" in text, text
    for head_dim, dims in (("0", 0), ("7", 7), ("null model.random.hidden_size=12", 3)):
        text = plan_errors(outputs, *TINY, *f"model.random.head_dim={head_dim}".split())
        assert f"heads of {dims} dims: RoPE rotates pairs" in text, text
    cut = tmp_path / "cut.gguf"
    with open(packaged_smollm2_gguf(), "rb") as f:
        cut.write_bytes(f.read(1 << 16))  # a download cut short: the magic, then nothing whole
    text = plan_errors(outputs, "device=cpu", f"model.path={cut}")
    assert f"model.path='{cut}': not a readable GGUF file" in text, text
    text = plan_errors(outputs, *TINY, f"seed={2**70}", "graph.prefill_buckets=[0,-1]", "eval.temperature=inf")
    assert f"seed={2**70}" in text and "graph.prefill_buckets=[0, -1]" in text and "eval.temperature=inf" in text


def test_a_store_runs_cannot_use_is_named_at_plan_time(outputs, tmp_path):
    text = plan_errors(outputs, *TINY, "tracking.tracking_uri=foo://bar")
    assert "tracking.tracking_uri='foo://bar': no MLflow store for the scheme 'foo'" in text, text
    text = plan_errors(outputs, *TINY, f"tracking.tracking_uri={tmp_path}/mlruns")  # MLflow's traceback at the run
    assert f"tracking.tracking_uri='{tmp_path}/mlruns': a folder: MLflow's file store, which it refuses" in text, text
    (outputs / "mlflow.db").write_bytes(b"garbage")
    text = plan_errors(outputs, *TINY)
    assert f"{outputs / 'mlflow.db'} is not an SQLite database" in text, text
    t0 = time.monotonic()
    text = plan_errors(outputs, *TINY, "tracking.tracking_uri=http://127.0.0.1:1")
    assert "no tracking server answers there" in text and time.monotonic() - t0 < 10, text
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    text = plan_errors(
        outputs,
        *TINY,
        f"tracking.artifact_root={a_file}/art",
        "tracking.tracking_uri=sqlite:///" + str(tmp_path / "x.db"),
    )
    assert f"tracking.artifact_root='{a_file}/art': the folder is below a file" in text, text


def test_a_port_in_use_or_a_host_to_listen_on_is_named_at_plan_time(outputs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        text = plan_errors(outputs, "+experiment=serve", *TINY, f"serve.port={port}")
    assert f"serve.port={port}: cannot listen on 127.0.0.1:{port} (Address already in use)" in text, text
    # any free port (0) still needs a host of this machine (uvicorn's traceback at start before)
    text = plan_errors(outputs, "+experiment=serve", *TINY, "serve.port=0", "serve.host=192.0.2.1")  # TEST-NET-1
    assert "serve.host='192.0.2.1': cannot listen there (Cannot assign requested address)" in text, text
    text = plan_errors(outputs, "+experiment=serve", *TINY, "serve.host=no-such-host.invalid")
    assert "serve.host='no-such-host.invalid': does not resolve" in text, text
    text = plan_errors(outputs, "+experiment=serve", *TINY, "serve.model_name=")
    assert "serve.model_name='': empty (valid: a name, or null (model.name))" in text, text
    text = plan_errors(outputs, "+experiment=serve", *TINY, "serve.port=0", "serve.stream_interval=0")
    assert "serve.stream_interval=0" in text and ">= 1 (tokens a chunk)" in text, text
    text = plan_errors(outputs, "+experiment=serve", *TINY, "serve.port=0", "serve.join_rows=0")
    assert "serve.join_rows=0" in text and ">= 1 (prompts a prefill replay takes)" in text, text


def test_the_memory_plan_refuses_what_the_host_cannot_hold(outputs):
    have, _ = available_memory(torch.device("cpu"))
    text = plan_errors(outputs, *TINY, "eval.batch_size=100000")  # 100000 x 2049 slots x 1 KiB: 195 GiB
    assert "eval.batch_size=100000: weights" in text and "beyond the host's available memory" in text, text
    assert "KV cache (100000 x 2049 slots) 195.41 GiB + activations" in text, text
    text = plan_errors(outputs, *TINY, f"model.max_seq_len={10**9}")
    assert "a smaller model.max_seq_len (now 1000000000)" in text, text
    # the README's training recipe: 1024 rows of 2049 slots for the self-distillation batches
    cfg = to_run_config(compose_cfg("+experiment=train_eagle3_smollm2", "device=cpu"))
    need = 1024 * 2049 * 2 * 30 * 3 * 64 * 4  # rows x slots x the KV bytes of a SmolLM2 token in float32
    if need > have:
        with pytest.raises(PlanError, match=r"train.data.batch_size=1024: weights .* beyond the host's"):
            build_plan(cfg, outputs)
    else:
        build_plan(cfg, outputs)


def test_an_empty_outputs_variable_is_one_clear_error(tmp_path):
    run = cli(*TINY, "dry_run=true", outputs=tmp_path, env={"SPECPIPE_OUTPUTS": ""}, timeout=120)
    assert run.returncode == 2 and "SPECPIPE_OUTPUTS='': set but empty" in run.stderr, run.stderr[-2000:]


def test_dependent_launches_without_a_gpu_that_has_them_are_a_plan_error(outputs):
    text = plan_errors(outputs, *TINY, "model.pdl=true")
    assert "model.pdl=True: needs the fused kernels on a Hopper or later GPU (run device: cpu, model.fused off)" in text
    assert "(valid: false, or null (on where it pays))" in text, text
    build_plan(to_run_config(compose_cfg(*TINY, "model.pdl=false")), outputs)
