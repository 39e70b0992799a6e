"""Draft checkpoints stored in fp8 with per-channel scales (engine/drafts/storage.py): the error bound of
the rounding, what stays unquantized, the plan and loader reading either form, the bf16 export, and
the shipped heads' size budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.models import pair
from helpers.runs import compose_cfg
from helpers.spec import AUX

from engine.drafts.registry import draft_config, load_head, plan_draft
from engine.drafts.storage import FP8, SCALE_SUFFIX, dequantize, quantize, read_state, write_checkpoint
from engine.errors import PlanError
from pipeline.__main__ import run

CHECKPOINTS = Path(__file__).resolve().parents[1] / "engine" / "drafts" / "checkpoints"


def test_fp8_rounding_stays_within_e4m3s_bound_per_channel():
    """Each element comes back within half an e4m3 step: 2^-4 of itself, or 2^-10 of its channel's
    scale below the normal range; channels of very different magnitude keep their own precision."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * torch.logspace(-4, 2, 256)[:, None]  # [out, in], 6 decades
    q = quantize({"proj.weight": w, "norm.weight": torch.ones(512), "d2t": torch.arange(512)})
    assert q["proj.weight"].dtype == FP8 and q["proj.weight" + SCALE_SUFFIX].shape == (256,)
    assert torch.equal(q["norm.weight"], torch.ones(512)) and torch.equal(q["d2t"], torch.arange(512))  # as they were
    back = dequantize(q)
    assert set(back) == {"proj.weight", "norm.weight", "d2t"}
    scale = q["proj.weight" + SCALE_SUFFIX][:, None]
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * 1.001
    assert ((back["proj.weight"] - w).abs() <= bound).all()
    rel = (back["proj.weight"] - w).norm(dim=1) / w.norm(dim=1)  # per channel
    assert rel.max() < 0.04


def test_an_fp8_checkpoint_plans_and_loads_like_its_bf16_form(tmp_path):
    """A head saved, rewritten as fp8 and back as bf16: the plan reads the same shapes from all three,
    the fp8 file is about half the bf16 one, and the loaded weights agree within fp8's rounding."""
    _, target = pair()
    cfg = draft_config("eagle3", init="random", draft_vocab_size=200, aux_layer_ids=AUX)
    head = load_head(plan_draft(cfg, target.args), target, 0, torch.device("cpu"), torch.float32)
    head.save(tmp_path / "fp32")
    bf16 = write_checkpoint(tmp_path / "fp32", tmp_path / "bf16", "bf16")
    fp8 = write_checkpoint(tmp_path / "bf16", tmp_path / "fp8", "fp8")
    assert fp8.stat().st_size < 0.6 * bf16.stat().st_size
    heads = {}
    for form in ("fp32", "bf16", "fp8"):
        plan = plan_draft(draft_config("eagle3", init="checkpoint", path=str(tmp_path / form)), target.args)
        assert (
            plan.checkpoint.shapes
            == plan_draft(
                draft_config("eagle3", init="checkpoint", path=str(tmp_path / "fp32")), target.args
            ).checkpoint.shapes
        )
        heads[form] = load_head(plan, target, 0, torch.device("cpu"), torch.float32).state_dict()
    for name, w in heads["fp32"].items():
        if w.is_floating_point() and w.dim() == 2:
            err = lambda other, name=name, w=w: ((heads[other][name] - w).norm() / w.norm()).item()
            assert err("bf16") < 0.01 and err("fp8") < 0.04, name
        else:
            assert torch.equal(heads["fp8"][name], w), name  # norms (bf16-exact here) and vocabulary maps
    # the bf16 export of the fp8 file is the public layout: plain tensors, no scales
    back = write_checkpoint(tmp_path / "fp8", tmp_path / "public", "bf16")
    assert not any(k.endswith(SCALE_SUFFIX) for k in read_state(back))
    assert json.loads((tmp_path / "public" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_an_fp8_head_drafts_end_to_end(tmp_path, outputs):
    """An eval with an fp8 checkpoint plans, loads and drafts; greedy output stays the target's."""
    _, target = pair()
    cfg = draft_config("eagle3", init="random", draft_vocab_size=200, aux_layer_ids=AUX)
    load_head(plan_draft(cfg, target.args), target, 0, torch.device("cpu"), torch.float32).save(tmp_path / "h")
    write_checkpoint(tmp_path / "h", tmp_path / "h8", "fp8")
    ctx = run(
        compose_cfg(
            "+experiment=eagle3",
            "model=tiny",
            "device=cpu",
            "eval.limit=2",
            "eval.max_new_tokens=8",
            f"draft.path={tmp_path / 'h8'}",
            "draft.num_steps=2",
            "tracking=off",
        )
    )
    m = ctx["eval_results"]["metrics"]
    assert m["match_baseline"] == 1.0 and m["accept_length"] >= 1.0


def test_shipped_heads_fit_the_clone_budget():
    """Every shipped head under 15 MB, all of them under 40 MB: a clone stays small and the working
    tree still travels to a GPU host beside a model part."""
    sizes = {d.name: sum(f.stat().st_size for f in d.iterdir()) for d in CHECKPOINTS.iterdir() if d.is_dir()}
    assert sizes and all(s <= 15_000_000 for s in sizes.values()), sizes
    assert sum(sizes.values()) <= 40_000_000


@pytest.mark.fresh_store
def test_a_broken_checkpoint_file_is_one_clear_error_before_any_weights_load(tmp_path, outputs):
    """A truncated model.safetensors (cut in its tensors, or in its header), random bytes (whose header
    length would claim exabytes) and a header that is not JSON: each fails the plan, naming draft.path
    and the file, with exit 2 and no MLflow run."""
    import subprocess
    import sys

    from pipeline.paths import REPO

    _, target = pair()
    cfg = draft_config("eagle3", init="random", draft_vocab_size=200, aux_layer_ids=AUX)
    load_head(plan_draft(cfg, target.args), target, 0, torch.device("cpu"), torch.float32).save(tmp_path / "good")
    data = (tmp_path / "good" / "model.safetensors").read_bytes()
    cases = {
        "cut": (data[: len(data) // 2], "truncated"),
        "header": (data[:200], "truncated"),
        "random": (
            torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
            .numpy()
            .tobytes(),
            "truncated, or not safetensors",
        ),
        "notjson": (len(b"{nope").to_bytes(8, "little") + b"{nope" + bytes(16), "not JSON"),
    }
    env = {**__import__("os").environ, "SPECPIPE_OUTPUTS": str(outputs)}
    for name, (content, why) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
        (d / "model.safetensors").write_bytes(content)
        overrides = ["+experiment=eagle3", "model=tiny", "device=cpu", f"draft.path={d}", "eval.limit=1"]
        if name == "cut":  # as a user types it: exit 2, one message, no traceback
            p = subprocess.run(
                [sys.executable, "-m", "pipeline", *overrides],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-1500:]
            message = p.stderr
        else:  # the same plan check in this process
            with pytest.raises(PlanError) as e:
                run(compose_cfg(*overrides))
            message = str(e.value)
        assert f"draft.path='{d}'" in message and str(d / "model.safetensors") in message and why in message, (
            name,
            message[-1500:],
        )
        assert not (outputs / "mlflow.db").exists(), name


def test_a_pytorch_model_bin_head_plans_and_loads_like_its_safetensors_form(tmp_path):
    """The EAGLE authors' releases ship pytorch_model.bin: the plan reads its shapes and the head loads
    the same weights as from model.safetensors; a truncated .bin is one clear error before loading."""
    _, target = pair()
    cfg = draft_config("eagle3", init="random", draft_vocab_size=200, aux_layer_ids=AUX)
    head = load_head(plan_draft(cfg, target.args), target, 0, torch.device("cpu"), torch.float32)
    head.save(tmp_path / "st")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(read_state(tmp_path / "st" / "model.safetensors"), tmp_path / "bin" / "pytorch_model.bin")
    plans = {
        f: plan_draft(draft_config("eagle3", init="checkpoint", path=str(tmp_path / f)), target.args)
        for f in ("st", "bin")
    }
    assert plans["bin"].checkpoint.shapes == plans["st"].checkpoint.shapes
    loaded = {f: load_head(p, target, 0, torch.device("cpu"), torch.float32).state_dict() for f, p in plans.items()}
    for name, w in loaded["st"].items():
        assert torch.equal(loaded["bin"][name], w), name
    data = (tmp_path / "bin" / "pytorch_model.bin").read_bytes()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception, match="pytorch_model.bin"):
        plan_draft(draft_config("eagle3", init="checkpoint", path=str(tmp_path / "bin")), target.args)
