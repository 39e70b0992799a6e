"""End to end on a tiny random model: the runner, the real MLflow store, the comparison report, the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers.runs import cli, compose_cfg, download_text, parent_and_children, runs_of

from engine.errors import ConfigError
from pipeline.__main__ import run
from pipeline.compare import compare
from pipeline.paths import REPO

TINY = ("model=tiny", "eval.limit=3", "eval.max_new_tokens=8", "device=cpu")


@pytest.mark.fresh_store
def test_tiny_eval_run_is_tracked(outputs):
    ctx = run(
        compose_cfg(
            "+experiment=baseline",
            *TINY,
            "eval.batch_size=2",
            "eval.peers=[hf_generate,hf_static_compile,hf_prompt_lookup,torch_compile]",
        )
    )
    metrics = ctx["eval_results"]["metrics"]
    assert metrics["generated_tokens"] == sum(len(r.result.tokens) for r in ctx["eval_results"]["records"])
    for peer in ("hf_generate", "hf_static_compile", "hf_prompt_lookup", "torch_compile"):
        assert metrics[f"peer_match.{peer}"] == 1.0, peer  # same weights, greedy, fp32: the same tokens
        assert metrics[f"peer_warmup_s.{peer}"] > 0, peer  # the warm-up is timed apart from the passes

    (r,) = runs_of(outputs, "baseline")
    assert r.info.status == "FINISHED"
    assert r.data.params["model.source"] == "random" and r.data.params["eval.batch_size"] == "2"
    for tag in ("git_sha", "device", "torch_version"):
        assert r.data.tags[tag]
    assert r.data.tags["torch_version"] == torch.__version__
    for m in ("tokens_per_s", "ttft_ms", "tpot_ms", "generated_tokens", "peak_mem_mb", "ratio_vs.hf_generate"):
        assert m in r.data.metrics and r.data.metrics[m] > 0
    assert r.data.metrics["generated_tokens"] == metrics["generated_tokens"]

    lines = [json.loads(x) for x in download_text(outputs, r.info.run_id, "results.jsonl").splitlines()]
    assert [x["id"] for x in lines] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(x["tokens"] == len(x["token_ids"]) > 0 and x["time_s"] > 0 for x in lines)
    assert "eval:\n  dataset: humaneval" in download_text(outputs, r.info.run_id, "config.yaml")


def test_failure_marks_the_run_failed(outputs, tmp_path):
    # Input embeddings that change shape between the plan (which checked them) and the run: found when
    # they are read, inside the run.
    from pipeline.config import to_run_config
    from pipeline.execute import execute
    from pipeline.plan import build_plan

    torch.save(torch.zeros(3, 64), tmp_path / "e.pt")
    qs = tmp_path / "question.jsonl"
    qs.write_text(json.dumps({"question_id": 0, "prompt_token_ids": [256, 72, 105], "input_embeds": "e.pt"}) + "\n")
    plan = build_plan(to_run_config(compose_cfg(*TINY, f"eval.dataset={qs}", "experiment_name=fails")), outputs)
    torch.save(torch.zeros(2, 64), tmp_path / "e.pt")
    with pytest.raises(ConfigError, match="input_embeds of shape"):
        execute(plan)
    (r,) = runs_of(outputs, "fails")
    assert r.info.status == "FAILED"


def test_question_jsonl_dataset_path(outputs, tmp_path):
    qs = tmp_path / "question.jsonl"
    qs.write_text(
        "".join(json.dumps({"question_id": i, "category": "t", "turns": [f"Say {i}"]}) + "\n" for i in range(3))
    )
    ctx = run(compose_cfg(*TINY, f"eval.dataset={qs}", "tracking=off"))
    assert [r.prompt.id for r in ctx["eval_results"]["records"]] == ["0", "1", "2"]
    assert runs_of(outputs, "default") == []  # tracking=off: no run


def test_compare_shows_what_differs(outputs):
    run(compose_cfg(*TINY, "experiment_name=cmp", "eval.batch_size=1"))
    run(compose_cfg(*TINY, "experiment_name=cmp", "eval.batch_size=3"))
    text = compare("cmp", f"sqlite:///{outputs / 'mlflow.db'}")
    assert "2 run(s)" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[1:] if line.strip()}
    assert rows["eval.batch_size"] == ["3", "1"]  # newest first
    assert "model.source" not in rows  # the same in both: not a row
    assert "tokens_per_s" in rows and "FINISHED" in rows["status"]
    with pytest.raises(ConfigError, match="no such experiment"):
        compare("nope", f"sqlite:///{outputs / 'mlflow.db'}")


@pytest.mark.fresh_store
def test_cli_dry_run_prints_plan_and_exits_0(outputs):
    p = cli("+experiment=baseline", "model=tiny", "dry_run=true", outputs=outputs)
    assert p.returncode == 0, p.stderr
    assert "1. load" in p.stdout and "2. eval" in p.stdout and "experiment: baseline" in p.stdout
    assert not (outputs / "mlflow.db").exists()  # nothing ran, nothing tracked


@pytest.mark.fresh_store
def test_cli_bad_input_is_one_clear_error(outputs):
    p = cli("model=tiny", "eval.dataset=nope", "device=cpu", outputs=outputs)
    assert p.returncode == 2
    assert "error: invalid run configuration" in p.stderr and "eval.dataset='nope'" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (outputs / "mlflow.db").exists()


def dry_run(capsys, *overrides: str) -> str:
    """The plan `dry_run=true` prints (in this process: the CLI's own path is test_cli_dry_run_*'s)."""
    capsys.readouterr()
    assert run(compose_cfg(*overrides, "dry_run=true", "device=cpu")) == {}
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "experiment, head", [("eagle3", "eagle3"), ("eagle", "eagle"), ("mtp", "mtp"), ("dflash", "dflash")]
)
def test_every_draft_experiment_plans_its_shipped_head(outputs, capsys, experiment, head):
    """dry_run names the checkpoint each draft experiment loads by default: the head shipped for it."""
    plan = dry_run(capsys, f"+experiment={experiment}")
    assert f"checkpoints/smollm2-135m-instruct-{head}," in plan and "RANDOM" not in plan


def test_the_plan_warns_of_random_weights(outputs, capsys):
    """A draft with random weights is called out in the plan with the recipe that trains one, and not in
    a training run."""
    mtp = dry_run(capsys, "+experiment=mtp", "draft.init=random")
    assert "RANDOM-WEIGHT head" in mtp
    assert "note: the multi_layer_eagle head has RANDOM WEIGHTS" in mtp
    assert "+experiment=train_mtp_smollm2" in mtp
    assert "RANDOM WEIGHTS" not in dry_run(capsys, "+experiment=train_mtp_smollm2", "train.data.batch_size=8")


@pytest.mark.fresh_store
def test_several_bad_values_are_reported_together(outputs):
    """Three bad eval values at once: one message names all three, exit 2, nothing tracked."""
    p = cli("model=tiny", "device=cpu", "eval.max_new_tokens=-1", "eval.batch_size=0", "eval.top_p=2", outputs=outputs)
    assert p.returncode == 2, p.stderr[-2000:]
    for key in ("eval.max_new_tokens=-1", "eval.batch_size=0", "eval.top_p=2"):
        assert key in p.stderr, (key, p.stderr[-2000:])
    assert not (outputs / "mlflow.db").exists()


@pytest.mark.fresh_store
def test_a_question_record_without_a_turn_fails_the_plan(outputs, tmp_path):
    """A record with no (or an empty) first turn would be answered as an empty prompt: the plan refuses
    the file, naming the line, before any weights load and without an MLflow run."""
    qs = tmp_path / "question.jsonl"
    qs.write_text(
        json.dumps({"question_id": 1, "turns": ["Say 1"]}) + "\n" + json.dumps({"question_id": 2, "turns": [""]}) + "\n"
    )
    p = cli("model=tiny", f"eval.dataset={qs}", "device=cpu", outputs=outputs)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "line 2 is not a question record" in p.stderr and "turns" in p.stderr
    assert "[load]" not in p.stdout and not (outputs / "mlflow.db").exists()


def test_cli_compare(outputs):
    run(compose_cfg(*TINY, "experiment_name=clicmp"))
    p = cli("--experiment", "clicmp", outputs=outputs, module="pipeline.compare", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "1 run(s)" in p.stdout and "tokens_per_s" in p.stdout


@pytest.mark.fresh_store
def test_a_sweep_with_bad_jobs_says_so_before_any_job_runs(outputs, tmp_path):
    """Every job is checked as its single run would be before the first runs: the third job's
    eval.max_new_tokens=-1 and a mistyped key (every job's) are one error each, exit 2, and nothing ran
    (no MLflow store, no sweep folder)."""
    p = cli(
        "-m",
        "model=tiny",
        "eval.limit=1",
        "eval.max_new_tokens=2,3,-1",
        "eval.batch_sizes=1",
        "device=cpu",
        f"hydra.sweep.dir={tmp_path}/mr",
        outputs=outputs,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("  - ")]
    assert len(errors) == 2, p.stderr
    assert any("eval.max_new_tokens=-1: out of range" in e for e in errors), p.stderr
    assert any("eval.batch_sizes='1': no such key (valid: eval.batch_size," in e for e in errors), p.stderr
    assert "Traceback" not in p.stderr and "[load]" not in p.stdout
    assert not (outputs / "mlflow.db").exists() and not (tmp_path / "mr").exists()


def test_command_lines_hydra_would_refuse_or_crash_on_are_one_error(outputs, tmp_path):
    """Each is one line naming the override, exit 2: what Hydra's grammar rejects (a traceback before),
    several values without -m, a group chosen twice, an empty experiment name (MLflow's traceback at
    the run's start), a Hydra folder no run can write (Hydra's FileNotFoundError)."""
    (tmp_path / "file").write_text("")
    for args, said in [
        (("eval.limit=[",), "eval.limit='[': not an override"),
        (("-m", "eval.limit=1,[2"), "eval.limit='1,[2': not an override"),
        (("eval.limit=1,2",), "eval.limit='1,2': several values, which only a sweep (-m) takes"),
        (("+experiment=eagle3", "+experiment=dflash"), "experiment='eagle3,dflash': chosen more than once"),
        (("experiment_name=",), "experiment_name='': empty"),
        ((f"hydra.run.dir={tmp_path}/file/run",), f"hydra.run.dir='{tmp_path}/file/run': the folder is below a file"),
    ]:
        p = cli("model=tiny", "device=cpu", *args, outputs=outputs)
        assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_a_sweep_whose_job_fails_at_plan_time_fails_its_parent_run(outputs, tmp_path):
    """A check only the job makes (its memory, on the device its worker takes): the second job's batch
    does not fit, so exit 2 with the key named, the first job's run FINISHED, and the sweep's parent
    run FAILED (not left RUNNING)."""
    p = cli(
        "-m",
        "model=tiny",
        "eval.limit=1",
        "eval.max_new_tokens=2",
        "eval.batch_size=1,1000000",
        "device=cpu",
        "experiment_name=badsweep",
        f"hydra.sweep.dir={tmp_path}/mr",
        outputs=outputs,
    )
    assert p.returncode == 2 and "eval.batch_size=1000000" in p.stderr, p.stderr[-2000:]
    parent, children = parent_and_children(outputs, "badsweep")
    assert parent.info.status == "FAILED"
    assert [c.info.status for c in children] == ["FINISHED"]


def test_sweep_nests_jobs_under_a_parent_run(outputs, tmp_path):
    p = cli(
        "-m",
        "model=tiny",
        "eval.limit=1",
        "eval.max_new_tokens=2",
        "eval.batch_size=1,2",
        "device=cpu",
        "experiment_name=sweep",
        f"hydra.sweep.dir={tmp_path}/mr",
        outputs=outputs,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    parent, children = parent_and_children(outputs, "sweep")  # one parent, every other run its child
    assert len(children) == 2
    assert "eval.batch_size=1,2" in parent.data.tags["sweep.overrides"]
    assert parent.info.status == "FINISHED" and all(c.info.status == "FINISHED" for c in children)
    assert sorted(c.data.params["eval.batch_size"] for c in children) == ["1", "2"]


def test_the_named_prompt_sets_ship_with_the_package():
    """mt_bench, gsm8k, alpaca and humaneval_80 load from engine/data (a clone with nothing beside it runs
    eval=mt_bench): 80 question records each, every one with a first turn; humaneval is the package's 164."""
    from engine.prompts import DATA, load_prompts

    for name in ("mt_bench", "gsm8k", "alpaca", "humaneval_80"):
        prompts = load_prompts(name)
        assert len(prompts) == 80 and all(p.text.strip() for p in prompts), name
        assert (DATA / name / "question.jsonl").resolve().is_relative_to(REPO)
    assert len(load_prompts("humaneval")) == 164
    assert "Apache" in (DATA / "README.md").read_text() and "CC BY-NC 4.0" in (DATA / "README.md").read_text()


def _shell_sigint() -> None:
    """In the child before exec: SIGINT as a shell leaves it (default action, unblocked), whatever the
    test process's own signal state is after the tests before this one."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _without_bars(log: str) -> str:
    """A child's stderr for an assertion message: the lines other than progress bars, the last 3000 chars."""
    return "\n".join(line for line in log.replace("\r", "\n").splitlines() if "eval:" not in line)[-3000:]


def test_ctrl_c_during_an_eval_keeps_what_finished_and_kills_the_run(outputs):
    """SIGINT once the first prompts have finished: exit 130 without a traceback, the MLflow run KILLED
    (not FAILED), and the finished prompts' records kept as an artifact."""
    import signal

    env = {**os.environ, "SPECPIPE_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "model=tiny",
            "device=cpu",
            # 164 prompts of up to 256 tokens: about 40 s of eval to land in (the signal goes at the first
            # finished prompt; at 64 tokens, 12 s, the signal twice landed after the pass in a full suite)
            "eval.max_new_tokens=256",
            "experiment_name=ctrlc",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_shell_sigint,
    )
    # Wait for the progress bar's first finished prompt, reading what the pipe holds and searching only its
    # tail: a reader that lags the bar (a char at a time, the whole log searched each time) can see the
    # first prompt only after the pass has ended, and the signal then lands after the eval.
    seen, fd = "", p.stderr.fileno()
    while not re.search(r"eval: [^\r\n]*?\b[1-9]\d*/\d+", seen[-400:]):
        chunk = os.read(fd, 65536).decode(errors="replace")
        assert chunk, seen[-2000:]
        seen += chunk
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    err = seen + err
    assert p.returncode == 130, _without_bars(err)
    assert "Traceback" not in err and "interrupted (Ctrl-C)" in err, _without_bars(err)
    assert "[eval] interrupted during the eval pass" in out, (out[-2000:], err[-2000:])
    (r,) = runs_of(outputs, "ctrlc")  # (interrupted: its results.jsonl holds the prompts that finished)
    assert r.info.status == "KILLED", (r.info.status, out[-2000:], err[-2000:])
    kept = download_text(outputs, r.info.run_id, "results.jsonl").splitlines()
    assert 1 <= len(kept) and all(json.loads(line)["output"] is not None for line in kept)


def test_an_outputs_folder_runs_cannot_write_is_one_clear_error(tmp_path):
    """SPECPIPE_OUTPUTS naming a file, a folder below a file, or a read-only folder: exit 2 at plan time
    naming the variable."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        cases = [(a_file, "is a file"), (a_file / "outputs", "is below a file")]
        if not os.access(read_only, os.W_OK):  # (root writes anywhere: no read-only folder to try)
            cases.append((read_only / "outputs", "is not writable"))
        for path, why in cases:
            p = cli("model=tiny", "device=cpu", "eval.limit=1", outputs=path)
            assert p.returncode == 2, p.stderr[-2000:]
            assert f"SPECPIPE_OUTPUTS='{path}'" in p.stderr and why in p.stderr and "Traceback" not in p.stderr
    finally:
        read_only.chmod(0o700)


def test_a_run_that_fails_mid_eval_keeps_its_partial_results(outputs, monkeypatch, capsys):
    """A fault injected into the second prompt's generation (as a device error would strike): the run
    ends FAILED and the first prompt's record is kept in results.jsonl."""
    from engine.speculative.generate import Generator

    real, calls = Generator.generate, []

    def failing(self, *a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected: the device went away")
        return real(self, *a, **kw)

    monkeypatch.setattr(Generator, "generate", failing)
    with pytest.raises(RuntimeError, match="injected"):
        run(
            compose_cfg(
                "model=tiny",
                "device=cpu",
                "eval.limit=3",
                "eval.max_new_tokens=4",
                "eval.warmup=false",
                "experiment_name=partial",
            )
        )
    assert "failed during the eval pass: 1 prompts had finished" in capsys.readouterr().out
    (r,) = runs_of(outputs, "partial")
    assert r.info.status == "FAILED"
    (line,) = download_text(outputs, r.info.run_id, "results.jsonl").splitlines()
    assert json.loads(line)["tokens"] >= 1


@pytest.mark.fresh_store
def test_hydra_composition_errors_are_config_errors_with_a_hint_that_works(outputs):
    """A misspelt key, a group without its +, an unknown config and a value of the wrong type: exit 2 in
    the pipeline's format, and the hint for the misspelling is the real key (Hydra's was `+eval.limt=2`)."""
    for args, said in [
        (["eval.limt=2"], "eval.limt='2': no such key (valid: eval.limit"),
        (["experiment=eagle3"], "valid: +experiment=eagle3"),
        (["graph=nope"], "graph='nope': no such config (valid: bcg, breakable"),
        (["eval.limit=abc"], "eval.limit='abc': wrong type"),
    ]:
        p = cli("model=tiny", *args, outputs=outputs)
        assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, (args, p.stderr[-1500:])
    p = cli("model=tiny", "eval.limit=2", "dry_run=true", outputs=outputs)  # the hint's command runs
    assert p.returncode == 0, p.stderr[-1500:]
    assert not (outputs / "mlflow.db").exists()
