"""Run figures, the cross-experiment comparison and a sweep's summary, on the tiny model and a real MLflow store."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib.image
import pytest
from helpers.runs import cli, compose_cfg, parent_and_children
from mlflow.tracking import MlflowClient

from engine.errors import ConfigError, PlanError
from pipeline.__main__ import run
from pipeline.compare import compare

TINY = ("model=tiny", "eval.limit=2", "eval.max_new_tokens=4", "device=cpu")
EAGLE3_TINY = (
    "+experiment=eagle3",
    "graph=debug",
    "draft.init=random",
    "draft.aux_layer_ids=[1,2,3]",
    "draft.num_steps=3",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def client(outputs: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")


def only_run(outputs: Path, experiment: str):
    c = client(outputs)
    (r,) = c.search_runs([c.get_experiment_by_name(experiment).experiment_id])
    return r


def figures_of(outputs: Path, run_id: str) -> dict[str, Path]:
    c = client(outputs)
    names = [a.path.split("/")[-1] for a in c.list_artifacts(run_id, "figures")]
    return {n: Path(c.download_artifacts(run_id, f"figures/{n}", str(outputs / "dl" / run_id))) for n in names}


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    h, w, _ = matplotlib.image.imread(path).shape  # decodes: a whole image, not just a header
    assert h > 100 and w > 100, (path, h, w)


def test_an_eval_run_logs_its_figures_and_system_metrics(outputs, capsys):
    """A draft run logs all three figures and (enabled) system metrics; a baseline-only run has no
    acceptance or phases to draw: only its tokens/s figure, and with system metrics off, none of those."""
    run(compose_cfg(*EAGLE3_TINY, *TINY, "tracking.system_metrics=true", "tracking.system_metrics_interval_s=0.2"))
    draft = only_run(outputs, "eagle3")
    figs = figures_of(outputs, draft.info.run_id)
    assert sorted(figs) == ["accept_rate_per_position.png", "round_phases.png", "tokens_per_s.png"]
    for path in figs.values():
        assert_png(path)
    assert draft.data.metrics["system/cpu_utilization_percentage"] >= 0
    assert "system/system_memory_usage_megabytes" in draft.data.metrics
    out = capsys.readouterr().out
    artifacts = draft.info.artifact_uri.removeprefix("file://")
    assert "results.jsonl, figures/accept_rate_per_position.png" in out and artifacts in out
    assert (Path(artifacts) / "figures" / "round_phases.png").is_file()  # the printed folder holds them

    run(compose_cfg("+experiment=baseline", *TINY, "tracking.system_metrics=false"))
    base = only_run(outputs, "baseline")
    (name,) = figures_of(outputs, base.info.run_id)
    assert name == "tokens_per_s.png"
    assert not any(k.startswith("system/") for k in base.data.metrics)


def test_system_metrics_without_a_positive_interval_is_a_config_error(outputs):
    with pytest.raises(PlanError, match=r"tracking.system_metrics_interval_s=0.0: .*> 0"):  # at plan time
        run(compose_cfg(*TINY, "tracking.system_metrics_interval_s=0", "experiment_name=badinterval"))


def test_compare_across_experiments_writes_csv_markdown_and_chart(outputs, tmp_path):
    run(compose_cfg("+experiment=baseline", *TINY, "tracking.system_metrics=false"))
    run(compose_cfg("+experiment=ngram", *TINY, "tracking.system_metrics=false"))
    base, ngram = only_run(outputs, "baseline"), only_run(outputs, "ngram")
    uri = f"sqlite:///{outputs / 'mlflow.db'}"
    text = compare("baseline,ngram", uri, out=tmp_path / "report")
    assert "experiments baseline, ngram: 2 run(s)" in text

    with open(tmp_path / "report" / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["experiment"], r["run_id"]) for r in rows] == [
        ("baseline", base.info.run_id),
        ("ngram", ngram.info.run_id),
    ]
    assert [r["draft.algorithm"] for r in rows] == ["none", "ngram"]  # a param that differs is a column
    assert float(rows[1]["tokens_per_s"]) == pytest.approx(ngram.data.metrics["tokens_per_s"])
    assert rows[0]["accept_length"] == "" and float(rows[1]["accept_length"]) >= 1  # no draft: no value

    md = (tmp_path / "report" / "compare.md").read_text().splitlines()
    assert "| experiment | baseline | ngram |" in md
    assert any(line.startswith("| draft.algorithm | none | ngram |") for line in md)
    assert_png(tmp_path / "report" / "compare.png")

    with pytest.raises(
        ConfigError, match=r"--experiment='baseline,nope': no such experiment: nope \(valid: .*baseline, ngram"
    ):
        compare("baseline,nope", uri)
    out = str(tmp_path / "x")
    p = cli("--experiment", "nope,ngram", "--out", out, outputs=outputs, module="pipeline.compare", timeout=120)
    assert p.returncode == 2 and "error: --experiment='nope,ngram': no such experiment: nope" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "x").exists()
    (tmp_path / "a_file").write_text("not a database")
    garbage, none = f"sqlite:///{tmp_path}/a_file", f"sqlite:///{tmp_path}/none.db"
    for args, said in [  # each one line, exit 2 (MLflow's tracebacks before, or a wait on a dead server)
        (("--tracking-uri", garbage), f"--tracking-uri='{garbage}': {tmp_path}/a_file is not an SQLite database"),
        (("--tracking-uri", str(tmp_path)), f"--tracking-uri='{tmp_path}': a folder: MLflow's file store"),
        (("--tracking-uri", none), f"--tracking-uri='{none}': no such file: no run has logged there yet"),
        (("--tracking-uri", "http://127.0.0.1:1"), "--tracking-uri='http://127.0.0.1:1': no tracking server answers"),
        (("--last", "0"), "--last=0: out of range (valid: >= 1)"),
        (("--out", str(tmp_path / "a_file")), f"--out='{tmp_path / 'a_file'}': the folder is a file"),
    ]:
        p = cli("--experiment", "ngram", *args, outputs=outputs, module="pipeline.compare", timeout=120)
        assert p.returncode == 2 and f"error: {said}" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "none.db").exists()  # looking creates no store


def test_a_sweep_ends_with_a_summary_of_its_jobs(outputs, tmp_path):
    sweep_dir = tmp_path / "mr"
    p = cli(
        "-m",
        *TINY,
        "eval.batch_size=1,2",
        "experiment_name=summary",
        "tracking.system_metrics=false",
        f"hydra.sweep.dir={sweep_dir}",
        outputs=outputs,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    c = client(outputs)
    parent, children = parent_and_children(outputs, "summary")
    assert [r.data.tags["sweep.job"] for r in children] == ["0", "1"]
    assert "eval.batch_size=2" in children[1].data.tags["sweep.job_overrides"]

    summary = p.stdout[p.stdout.index("sweep of 'summary': 2 run(s)") :]
    rows = {line.split()[0]: line.split()[1:] for line in summary.splitlines()[1:] if line.strip()}
    assert rows["eval.batch_size"] == ["1", "2"] and rows["run_id"] == [r.info.run_id[:8] for r in children]
    assert f"in {sweep_dir}" in summary

    with open(sweep_dir / "compare.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["label"], r["run_id"], r["eval.batch_size"]) for r in table] == [
        ("batch_size=1", children[0].info.run_id, "1"),  # labelled by the swept value
        ("batch_size=2", children[1].info.run_id, "2"),
    ]
    assert "| eval.batch_size | 1 | 2 |" in (sweep_dir / "compare.md").read_text()
    assert_png(sweep_dir / "compare.png")
    logged = sorted(a.path for a in c.list_artifacts(parent.info.run_id))
    assert logged == ["compare.csv", "compare.md", "compare.png"]
    assert c.get_run(parent.info.run_id).info.status == "FINISHED"
