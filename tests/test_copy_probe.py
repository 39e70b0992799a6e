"""benchmarks/copy_probe.py: the per-position rows it scores a head's first draft on agree with the
trainer's own held-out evaluation, and its fit of the copy candidates' logits finds an informative score."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from conftest import compose_cfg
from test_train_draft import TRAIN

from engine.drafts.registry import train_spec
from engine.train.data import VocabMap
from engine.train.trainer import Trainer
from pipeline.config import to_run_config
from pipeline.plan import build_plan
from stages.train_draft import settings, synthesize_data

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from copy_probe import fit, fit_projection, positions, project, report  # noqa: E402


def test_copy_probe_rows_agree_with_the_trainers_first_draft_accuracy(outputs, capsys):
    cfg = to_run_config(compose_cfg(*TRAIN))
    plan = build_plan(cfg)
    ctx = plan.set_up("load", "configure_aux_capture")
    target, head = ctx["target"], ctx["draft_head"]
    samples = synthesize_data(target, cfg.train.data)
    trainer = Trainer(
        head,
        target.model,
        samples,
        samples,
        VocabMap.of(head),
        settings(cfg, plan.env.device),
        plan.env.outputs_dir / "copy_probe",
        lambda *a, **k: None,
        train_spec(cfg.draft.algorithm),
    )
    rows = positions(trainer, samples, target.model.lm_head.weight)
    n = len(rows["own_hit"])
    assert n == sum(min(len(s.ids), cfg.train.max_len) - len(s.prompt_ids) for s in samples)  # every answer token
    assert abs(rows["own_hit"].float().mean().item() - trainer.evaluate()["val_acc_0"]) < 1e-6
    copyable = rows["extra_label"] >= 0
    own_vocab = rows["own_label"] > float("-inf")
    assert copyable.any() and not (copyable & own_vocab).any()  # a label is a draft token or a copy, never both
    picked = rows["extra"][copyable].gather(-1, rows["extra_label"][copyable][:, None])
    assert torch.isfinite(picked).all()  # a copy label is already in the context at its position
    a, b = fit(rows)
    assert math.isfinite(a) and math.isfinite(b) and a > 0
    capsys.readouterr()
    report("tiny", rows, a, b)
    line = capsys.readouterr().out.split()
    assert line[0] == "tiny" and int(line[1]) == n


def test_fit_finds_an_informative_copy_score_and_report_counts_the_copies(capsys):
    """Synthetic rows: the right copy candidate scores 4 above the others, and the head's own logits never
    win (own max -1 against logsumexp 0). The fit must scale the copy score up, and with it the first draft
    gets nearly every copyable position right and loses no own hit (it has none)."""
    g = torch.Generator().manual_seed(0)
    n = 2000
    label = torch.randint(-1, 3, (n,), generator=g)  # -1: an own-vocabulary label
    extra = torch.randn(n, 3, generator=g)  # [N, C]
    extra[torch.arange(n)[label >= 0], label[label >= 0]] += 4
    extra[::5, 2] = float("-inf")  # not yet in the context
    label[(label == 2) & (extra[:, 2] == float("-inf"))] = -1
    rows = {
        "own_lse": torch.zeros(n),
        "own_max": torch.full((n,), -1.0),
        "own_hit": torch.zeros(n, dtype=torch.bool),
        "own_label": torch.where(label < 0, 0.0, float("-inf")),
        "extra": extra,
        "extra_label": label,
    }
    a, b = fit(rows)
    assert a > 1.5
    capsys.readouterr()
    report("synthetic", rows, a, b)
    name, positions_, own, with_extras, copyable, copies_right, lost = capsys.readouterr().out.split()
    assert float(own) == 0 and float(with_extras) > 0.6 and float(copies_right) > 0.95 and float(lost) == 0
    assert abs(float(copyable) - (label >= 0).float().mean().item()) < 1e-3


def test_fit_projection_finds_a_copy_score_that_the_scalars_cannot(capsys):
    """Synthetic rows where x points at its copy's embedding row only after a fixed rotation R: x . E[tok]
    carries nothing, (x R^T) . E[tok] everything. The scalars of `fit` cannot use it; the rank-H correction
    of `fit_projection` must, and `project` with a zero correction gives back the rows' own scores."""
    g = torch.Generator().manual_seed(0)
    h, vocab, samples, per = 6, 40, 60, 20
    embed = torch.randn(vocab, h, generator=g)
    rot = torch.linalg.qr(torch.randn(h, h, generator=g)).Q  # [H, H] orthogonal
    r = {k: [] for k in ("own_label", "extra", "extra_label", "x", "groups")}
    for _ in range(samples):
        t = torch.randperm(vocab, generator=g)[:4]  # [C] this sample's out-of-vocabulary context tokens
        f, ps = torch.zeros(4, dtype=torch.long), torch.arange(per)  # all in the context from the start
        label = torch.randint(-1, 4, (per,), generator=g)  # -1: an own-vocabulary label
        x = 0.3 * torch.randn(per, h, generator=g)
        x[label >= 0] += 2 * embed[t[label[label >= 0]]] @ rot  # [n, H]: visible through x R^T only
        r["x"].append(x)
        r["extra"].append(x @ embed[t].T)
        r["extra_label"].append(label)
        r["own_label"].append(torch.where(label < 0, 0.0, float("-inf")))
        r["groups"].append((t, f, ps))
    r = {k: (v if k == "groups" else torch.cat(v)) for k, v in r.items()}
    n = len(r["x"])
    r.update(own_lse=torch.zeros(n), own_max=torch.full((n,), -1.0), own_hit=torch.zeros(n, dtype=torch.bool))
    assert torch.equal(project(r, embed, torch.zeros(h, 2), torch.zeros(h, 2)), r["extra"])

    def copies_right(a, b, extra=None):
        capsys.readouterr()
        report("synthetic", r, a, b, extra)
        return float(capsys.readouterr().out.split()[5])

    scalars = copies_right(*fit(r))
    a, b, u, v = fit_projection(r, embed, rank=h, steps=300)
    projected = copies_right(a, b, project(r, embed, u, v))
    assert projected > 0.9 and projected > scalars + 0.3
