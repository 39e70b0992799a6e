"""What a newcomer sees first: honest timings, plans of GPU runs on a CPU host, run folders that hold
their log, `--help`, the key reference, examples that finish."""

from __future__ import annotations

import ast
import itertools
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.runs import cli, compose_cfg

from engine.speculative.timing import BatchTiming, fmt_range, noise_warning, per_batch_speedups, unit_cost_spread
from pipeline.__main__ import run
from pipeline.config import to_run_config
from pipeline.help import GROUPS, REFERENCE, help_text, key_reference, options
from pipeline.paths import REPO
from pipeline.plan import PlanError, build_plan

EAGLE3_TINY = ("+experiment=eagle3", "graph=debug", "draft.init=random", "draft.aux_layer_ids=[1,2,3]")
NGRAM_TINY = ("+experiment=ngram", "model=tiny", "device=cpu", "eval.limit=4", "eval.max_new_tokens=16")


def test_a_ratio_comes_with_its_per_batch_spread_and_the_digits_it_supports():
    base = [BatchTiming(16, 0.10, 16), BatchTiming(16, 0.10, 16), BatchTiming(16, 0.10, 16)]
    draft = [BatchTiming(16, 0.05, 6), BatchTiming(16, 0.08, 8), BatchTiming(16, 0.05, 6)]
    speedups = per_batch_speedups(base, draft)
    assert speedups == pytest.approx([2.0, 1.25, 2.0])
    # a round cost 0.05/6 s in one batch and 0.08/8 in another: 20% apart, in baseline steps alike
    assert unit_cost_spread(base, draft) == pytest.approx((0.08 / 8) / (0.05 / 6) - 1)
    assert fmt_range(1.7, speedups) == "1.7 (per batch 1.2-2.0, 3 batches)"  # a spread of 0.4: one decimal
    assert fmt_range(1.234, [1.231, 1.236]) == "1.234 (per batch 1.231-1.236, 2 batches)"
    assert fmt_range(1.5, [1.5]) == "1.50 (one batch: no spread)"
    assert unit_cost_spread(base[:1], draft[:1]) != unit_cost_spread(base[:1], draft[:1])  # nan: no spread
    # quiet and steady: nothing to say; a wide spread or a loaded CPU: one line that says which and what to do
    assert noise_warning(speedups, 0.05, 0.1, 2, cpu=True, threads=2) is None
    line = noise_warning(speedups, 0.6, 0.1, 2, cpu=False, threads=2)
    assert "varied 60% between batches" in line and "1.25-2.00" in line and "GPU" in line and "\n" not in line
    line = noise_warning(speedups, 0.05, 1.4, 2, cpu=True, threads=2)
    assert "other processes kept 1.4 of this host's 2 CPU cores busy" in line and "OMP_NUM_THREADS=1" in line


def test_the_passes_alternate_by_batch_and_a_load_on_one_of_them_is_reported(outputs, monkeypatch, capsys):
    """A CPU burner runs beside the baseline's odd batches only: the passes still alternate batch by batch
    (ABBA), the per-batch speedups spread, and the summary says the timings are noisy and why."""
    from engine.speculative.generate import Generator
    from engine.speculative.timing import decimals_for

    real, order = Generator.generate, []

    def loaded(self, prompts, params, *a, **kw):
        if params.max_new_tokens == 4:  # the warm-ups
            return real(self, prompts, params, *a, **kw)
        order.append(self.k)
        if self.k == 0 and sum(k == 0 for k in order) % 2:  # a synthetic load on the baseline's odd batches
            burner = subprocess.Popen(
                [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 0.4: pass"]
            )
            try:
                return real(self, prompts, params, *a, **kw)
            finally:
                burner.wait()
        return real(self, prompts, params, *a, **kw)

    monkeypatch.setattr(Generator, "generate", loaded)
    m = run(compose_cfg(*NGRAM_TINY, "tracking=off"))["eval_results"]["metrics"]
    assert order == [0, 3, 3, 0, 0, 3, 3, 0]  # baseline (k=0) and draft (k=3) alternate which goes first
    assert m["speedup_min"] < m["speedup"] < m["speedup_max"] and m["round_cost_spread"] > 0.25
    out = capsys.readouterr().out
    d = decimals_for((m["speedup_max"] - m["speedup_min"]) / 2)  # the digits its spread supports
    assert f"{m['speedup']:.{d}f} (per batch {m['speedup_min']:.{d}f}-" in out and ", 4 batches)" in out
    (line,) = [x for x in out.splitlines() if x.startswith("WARNING: noisy timings")]
    assert "varied" in line and "; rerun " in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_a_cuda_plan_is_validated_and_printed_on_a_host_without_cuda(outputs):
    plan = build_plan(to_run_config(compose_cfg("+experiment=eagle3_bcg", "dry_run=true", "eval=quick")))
    text = plan.describe()
    assert "device: cuda (bfloat16)" in text and "target full, draft breakable" in text
    assert "3. capture_graphs" in text and "the first 4 of 80 prompts" in text
    assert "checked on the GPU only: that CUDA is there, the memory plan, graph capture" in text
    # device=cpu is declared: no GPU plan, the policy's error instead
    with pytest.raises(Exception, match=r"graph.target_policy='full': captures CUDA graphs \(target full, draft"):
        build_plan(to_run_config(compose_cfg("+experiment=eagle3_bcg", "dry_run=true", "device=cpu")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
@pytest.mark.fresh_store
def test_the_cpu_host_error_names_what_chose_the_policy_and_leaves_no_run_folder(outputs):
    p = cli("+experiment=eagle3_bcg", "eval=quick", outputs=outputs)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "graph='bcg': +experiment=eagle3_bcg chose it: target full, draft breakable" in p.stderr
    assert "dry_run=true to print the GPU run's plan" in p.stderr and "Traceback" not in p.stderr
    p = cli("+experiment=eagle3", "graph=full", "eval=quick", "dry_run=true", outputs=outputs)
    assert p.returncode == 0 and "device: cuda" in p.stdout, p.stderr[-2000:]
    assert not (outputs / "runs").exists()  # neither the failed plan nor the dry run left a folder


@pytest.mark.fresh_store
def test_a_run_folder_holds_the_plan_progress_and_summary(outputs):
    p = cli(*NGRAM_TINY, "tracking=off", outputs=outputs)
    assert p.returncode == 0, p.stderr[-2000:]
    (log,) = (outputs / "runs").glob("*/*/pipeline.log")
    text = log.read_text()
    assert "\r" not in text  # a progress bar's redraws collapse into its last state
    lines = text.splitlines()
    assert "  1. load" in "\n".join(lines) and "2. eval" in text  # the plan
    (bar,) = [x for x in lines if x.startswith("eval[ngram]:")]  # the progress line, once
    assert "4/4" in bar
    assert any(x.startswith("speedup ") for x in lines) and "[eval] tracking off" in text  # the summary


def test_help_says_what_the_tool_is_and_lists_every_group_and_experiment():
    p = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    text = p.stdout
    assert text.startswith("specpipe: speculative decoding") and "docs/configuration.md" in text
    groups = {d.name for d in (REFERENCE.parents[1] / "conf").iterdir() if d.is_dir() and not d.name.startswith("_")}
    groups = (groups - {"hydra", "experiment"}) | {"hydra/launcher", "hydra/sweeper"}
    assert groups == set(GROUPS)  # every group of conf/ has its line, and no line names a group that is gone
    for group in GROUPS:
        assert f"  {group} " in text and all(o in text for o in options(group)), group
    assert all(f"  {name} " in text for name in options("experiment"))
    assert text == help_text() + "\n"


def test_the_key_reference_is_current():
    """docs/configuration.md is generated from the schema's field comments: regenerate it with
    `python -m pipeline.help --write` after changing pipeline/config.py."""
    assert REFERENCE.read_text() == key_reference()
    text = REFERENCE.read_text()
    assert "| `eval.limit` | int | `null` | first N prompts; null: all |" in text
    assert "| `graph.target_policy` | str | `null` | (see `graph.policy`) |" in text


def test_compare_labels_runs_by_what_differs_fits_a_terminal_and_warns_of_other_work(outputs, tmp_path, monkeypatch):
    from pipeline.compare import compare

    monkeypatch.setenv("COLUMNS", "100")  # the terminal's width
    from pipeline.figures import comparison_figure

    tiny = ("model=tiny", "eval.max_new_tokens=4", "tracking.system_metrics=false")
    run(compose_cfg("+experiment=baseline", *tiny, "eval.limit=2"))
    run(compose_cfg("+experiment=baseline", *tiny, "eval.limit=2", "eval.batch_size=2"))
    run(compose_cfg(*EAGLE3_TINY, *tiny, "eval=quick", "eval.limit=1", "eval.ignore_eos=true"))
    text = compare("baseline,eagle3", f"sqlite:///{outputs / 'mlflow.db'}", out=tmp_path / "report")
    *lines, written = text.splitlines()
    assert max(len(x) for x in lines) <= 100, max(lines, key=len)  # (the last line: the folder the user named)
    assert written.endswith("report: compare.csv, compare.md, compare.png")
    headers = [lines[i + 1] for i, x in enumerate(lines) if i == 0 or x == ""]  # tables split to fit the width
    labels = [x.strip() for h in headers for x in h.split("  ") if x.strip()]
    assert labels == ["baseline batch_size=2", "baseline batch_size=1", "eagle3"]  # newest first
    assert "shared by every run:" in text and any(x.startswith("  model ") for x in lines)
    (warning,) = [x for x in lines if x.startswith("WARNING")]
    assert "eval.dataset, eval.limit" in text and "eval.ignore_eos" in text and "measured different work" in text
    assert "eagle3 |" in (tmp_path / "report" / "compare.md").read_text().splitlines()[2]
    # the chart draws a panel only for a measure some run has: no accept_length panel without a draft
    assert len(comparison_figure(["a", "b"], [10.0, 12.0], [None, None]).axes) == 1
    assert len(comparison_figure(["a", "b"], [10.0, 12.0], [None, 2.5]).axes) == 2


def test_a_runs_figures_are_titled_with_run_dataset_device_and_date(outputs):
    from pipeline.tracking import Tracker

    cfg = to_run_config(compose_cfg("model=tiny", "eval=quick", "tracking.system_metrics=false"))
    with Tracker(cfg, outputs, torch.device("cpu")) as t:
        title = t.figure_title({"num_prompts": 4.0})
        name = t.client.get_run(t.run_id).info.run_name
    assert title.startswith(f"run {name} (default) | mt_bench x4 | cpu (") and time.strftime("%Y-%m-%d") in title


TRAIN_TINY = ("+experiment=train_eagle3_tiny", "train.data.num_samples=128", "train.steps=60", "train.eval_every=30")


def test_the_tiny_training_recipe_learns_and_beats_a_random_head_in_the_real_loop(outputs, tmp_path, capsys):
    """+experiment=train_eagle3_tiny, shortened: the held-out acceptance and loss move well away from the
    untrained head's (step 0), and on held-out prompts the exported head drafts better than a random head
    through the eval's draft-and-verify loop, the output unchanged."""
    import json

    from mlflow.tracking import MlflowClient

    from engine.train.data import split
    from engine.train.selfdistill import Sample

    head = run(compose_cfg(*TRAIN_TINY, "train.loop_eval_prompts=4", "tracking.system_metrics=false"))
    out = capsys.readouterr().out
    assert "degenerate" not in out and "no better than a uniform guess" not in out
    assert re.search(r"held-out accept_length\(k=3\) [\d.]+ \(1\.0\d at step 0\), [\d.]+ in the real loop", out)
    c = MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")
    (r,) = c.search_runs([c.get_experiment_by_name("train_eagle3_tiny").experiment_id])
    acc = {m.step: m.value for m in c.get_metric_history(r.info.run_id, "val_accept_length_k3")}
    loss = {m.step: m.value for m in c.get_metric_history(r.info.run_id, "val_loss")}
    assert acc[0] < 1.1 and acc[60] > 1.5, acc
    assert loss[60] < 0.5 * loss[0] and loss[60] < 0.8 * math.log(320), loss
    assert r.data.metrics["data_top_token_share"] < 0.4  # no token dominates (model=tiny: one, above half)

    (data,) = (outputs / "train" / "data").glob("*/samples.jsonl")
    samples = [Sample(**json.loads(x)) for x in open(data)]
    heldout = split(samples, 0.1, 0)[1][:6]
    qfile = tmp_path / "question.jsonl"
    qfile.write_text("".join(json.dumps({"question_id": i, "turns": [s.user]}) + "\n" for i, s in enumerate(heldout)))
    common = ["+experiment=eagle3", "model=tiny_trainable", "draft.num_steps=3", f"eval.dataset={qfile}"]
    common += ["eval.max_new_tokens=32", "tracking=off"]
    trained = run(compose_cfg(*common, f"draft.path={head['draft_checkpoint']}"))["eval_results"]["metrics"]
    random_ = run(compose_cfg(*common, "draft.init=random", "draft.aux_layer_ids=[1,2,3]"))["eval_results"]["metrics"]
    assert trained["match_baseline"] == random_["match_baseline"] == 1.0
    assert trained["accept_length"] > random_["accept_length"] + 0.2, (trained, random_)


def test_self_distillation_on_a_target_that_repeats_one_token_warns(outputs, capsys):
    """The default tiny target (model=tiny) answers with one token over and over: the stage says so before
    training, and the loss at the end is no better than a uniform guess's."""
    run(compose_cfg(*TRAIN_TINY, "model=tiny", "train.steps=10", "train.loop_eval_prompts=0", "tracking=off"))
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("WARNING: degenerate data: token")]
    assert "answer tokens (" in line and "model=tiny_trainable" in line
    assert "is no better than a uniform guess's ln(320) = 5.768" in out


def test_the_smaller_things_say_what_happened(outputs, capsys):
    """graph=debug says it captured nothing; a peer pass has a progress bar; the plan names the prompts."""
    cfg = ("+experiment=baseline", "model=tiny", "graph=debug", "eval.limit=2", "eval.max_new_tokens=4")
    run(compose_cfg(*cfg, "eval.peers=[hf_generate]", "tracking=off"))
    out, err = capsys.readouterr()
    assert "graph shapes set up, none captured (debug" in out and " graphs in " not in out
    assert "humaneval: the first 2 of 164 prompts" in out
    assert re.search(r"peer: 100%[^\n]*2/2", err.replace("\r", "\n")), err[-1000:]


# ------------------------------------------------------------------------------------------ the docs' commands
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CPU_SECTION = "On a CPU (a laptop, a login node): minutes"


def doc_commands(path: Path) -> list[tuple[str, str, list[str]]]:
    """(the section heading, the module, its arguments) of every `python -m pipeline[.compare]` (or
    `torchrun ... -m pipeline`) line of the file's bash blocks; lines with a placeholder (`...`) left out."""
    out, heading, block, pending = [], "", False, ""
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            heading = line.lstrip("#").strip() if line.startswith("#") else heading
            continue
        pending += line.rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        words, pending = shlex.split(pending, comments=True), ""
        if "-m" in words and words.index("-m") + 1 < len(words) and "..." not in words:
            i = words.index("-m") + 1
            if words[i] in ("pipeline", "pipeline.compare"):
                out.append((heading, words[i], [w for w in words[i + 1 :] if w != "&"]))
    return out


def plans(args: list[str]) -> list[list[str]]:
    """A command line's job overrides (Hydra's own left out), one list per job of a sweep (-m)."""
    overrides = [a for a in args if a != "-m" and not a.startswith(("hydra/", "hydra."))]
    if "-m" not in args:
        return [overrides]
    split = [
        [f"{o.split('=', 1)[0]}={v}" for v in o.split("=", 1)[1].split(",")] if "," in o and "[" not in o else [o]
        for o in overrides
    ]
    return [list(job) for job in itertools.product(*split)]


def test_every_command_in_the_readme_and_docs_plans(outputs):
    """Each `python -m pipeline` line of README.md and docs/ composes and validates (dry_run): GPU runs too,
    planned for CUDA on a host without it; the only errors allowed are a model or head path under
    /models/ that this machine does not have, and a GPU recipe's memory beyond a host without a GPU."""
    found = [(p.name, *c) for p in DOCS for c in doc_commands(p)]
    assert len([c for c in found if c[2] == "pipeline"]) >= 30 and any(c[1] == CPU_SECTION for c in found)
    for name, heading, module, args in found:
        if module != "pipeline":
            continue
        for job in plans(args):
            try:
                build_plan(to_run_config(compose_cfg(*job, "dry_run=true")))
            except PlanError as e:
                absent = [
                    x.key in ("model.path", "draft.path")
                    and str(x.value).startswith("/models/")
                    or "this host has no GPU" in x.problem
                    for x in e.errors
                ]
                assert all(absent), (f"{name} ({heading}): {' '.join(args)}", str(e))


def test_each_graph_hazard_in_the_architecture_page_names_tests_that_exist():
    """docs/architecture.md's hazard table: hazards 1 to 13, each naming `tests/<file>.py::<test>` functions
    that are there (a renamed or removed test shows here)."""
    section = (REPO / "docs" / "architecture.md").read_text().split("## Graph hazards and their tests", 1)[1]
    rows = re.findall(r"^\| (\d+) \|(.*)$", section, re.M)
    assert [int(n) for n, _ in rows] == list(range(1, 14))
    for n, row in rows:
        refs = re.findall(r"`tests/(\w+\.py)::(\w+)`", row)
        assert refs, f"hazard {n} names no test"
        for file, name in refs:
            tree = ast.parse((REPO / "tests" / file).read_text())
            assert name in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, f"hazard {n}: {file}::{name}"


@pytest.mark.slow
@pytest.mark.fresh_store
@pytest.mark.skipif(os.environ.get("SPECPIPE_EXAMPLES") != "1", reason="about 3 minutes: SPECPIPE_EXAMPLES=1 runs it")
def test_the_cpu_examples_finish_in_minutes(outputs):
    """The README's CPU block, run as written, in order (the compare at the end reads the runs before it):
    every command ends with exit status 0, each within 5 minutes on a loaded 2-core host (165 s for all on
    2 cores beside other work: the shipped EAGLE3 head's eval=quick and the tiny training most of it)."""
    block = [(module, args) for heading, module, args in doc_commands(REPO / "README.md") if heading == CPU_SECTION]
    assert len(block) >= 6
    for module, args in block:
        t0 = time.perf_counter()
        p = cli(*args, outputs=outputs, module=module, timeout=300, env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (module, args, p.stdout[-2000:], p.stderr[-2000:])
        print(f"{time.perf_counter() - t0:.0f}s  python -m {module} {' '.join(args)}")
