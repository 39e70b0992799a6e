"""Files a kill can leave half-written: training checkpoints and the GGUF weights cache.

A checkpoint save (engine/train/checkpoints.py, the trainer's own `fill`: a real head and AdamW state) is
SIGKILLed at many points in a forked process: every time, the newest complete checkpoint is found, it
loads, and it is the last save that finished or the one being written. A resume whose head differs from
the checkpoint's is one error naming the differing keys.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.runs import compose_cfg
from helpers.train import TINY_TRAIN

from engine.drafts.checkpoint import HeadCheckpoint
from engine.drafts.eagle3 import Eagle3Head, eagle3_config
from engine.errors import ConfigError
from engine.loading import random_args
from engine.train import checkpoints
from pipeline.paths import REPO
from schema import RandomArchConfig

TRIALS = 24


def _head() -> Eagle3Head:
    return Eagle3Head(eagle3_config(random_args(RandomArchConfig()), [0, 1, 2], None, "own"), 64)


def _save_forever(out_dir: Path, head: Eagle3Head, opt: torch.optim.Optimizer, done) -> None:
    """Save `head` and its optimizer state at steps 1, 2, ..., reporting each finished save."""
    for step in range(1, 10**6):
        with torch.no_grad():
            for p in head.parameters():
                p.fill_(float(step))

        def fill(tmp: Path, step: int = step) -> None:
            head.save(tmp)
            torch.save({"optimizer": opt.state_dict(), "step": step}, tmp / "trainer_state.pt")

        checkpoints.write(out_dir, step, fill)
        done.put(step)


def test_a_save_killed_at_any_point_leaves_the_last_complete_checkpoint(tmp_path):
    ctx = multiprocessing.get_context("fork")  # the children start warm: no imports, no first-save costs
    rng = random.Random(0)
    head = _head()
    opt = torch.optim.AdamW(head.parameters())
    for p in head.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # AdamW's moments: what a real run's trainer_state.pt holds
    checkpoints.write(tmp_path / "warm", 0, lambda d: (head.save(d), torch.save(opt.state_dict(), d / "opt.pt")))
    kills = 0
    for trial in range(TRIALS):
        out = tmp_path / f"t{trial % 3}"  # three folders: later trials save over what earlier kills left
        done = ctx.Queue()
        p = ctx.Process(target=_save_forever, args=(out, head, opt, done))
        p.start()
        finished = [done.get(timeout=60)]  # the first save (when the folder is new)
        time.sleep(rng.random() * 0.08)  # then anywhere in the next saves (one takes about 40 ms here)
        p.kill()
        p.join()
        kills += p.exitcode == -9
        while not done.empty():
            finished.append(done.get())
        path = checkpoints.newest(out)
        assert path == out / "checkpoint", (trial, sorted(x.name for x in out.iterdir()))
        assert sorted(x.name for x in out.iterdir()) == ["checkpoint"]  # what a kill left: cleaned
        step = json.loads((path / checkpoints.MANIFEST).read_text())["step"]
        assert step in (finished[-1], finished[-1] + 1), (step, finished[-3:])
        ckpt = HeadCheckpoint.read(str(path), "LlamaForCausalLMEagle3")
        head = ckpt.load_into(_head())
        assert torch.all(head.fc.weight == float(step))
        assert torch.load(path / "trainer_state.pt", weights_only=False)["step"] == step
    assert kills == TRIALS


def test_incomplete_checkpoints_are_skipped_with_a_line(tmp_path, capsys):
    out = tmp_path / "train"
    checkpoints.write(out, 3, lambda d: (d / "a.bin").write_bytes(b"x" * 10))
    (out / "checkpoint.tmp").mkdir()
    (out / "checkpoint.tmp" / "a.bin").write_bytes(b"y" * 4)  # a save cut short: no manifest
    assert checkpoints.newest(out) == out / "checkpoint"
    assert "checkpoint.tmp is incomplete" in capsys.readouterr().out
    # a kill between the two renames: the new one under .tmp, the old under .old, no checkpoint/
    checkpoints.write(tmp_path / "other", 4, lambda d: (d / "a.bin").write_bytes(b"z" * 7))
    os.rename(out / "checkpoint", out / "checkpoint.old")
    os.rename(tmp_path / "other" / "checkpoint", out / "checkpoint.tmp")
    (tmp_path / "other").rmdir()
    assert checkpoints.newest(out) == out / "checkpoint"
    assert (out / "checkpoint" / "a.bin").read_bytes() == b"z" * 7 and sorted(os.listdir(out)) == ["checkpoint"]
    # a file of the wrong size (a torn write): not complete
    (out / "checkpoint" / "a.bin").write_bytes(b"z" * 3)
    assert checkpoints.newest(out) is None


def test_resuming_with_other_draft_settings_names_the_keys(outputs):
    from pipeline.__main__ import run

    train = [
        "+experiment=train_eagle3_smollm2",
        *TINY_TRAIN,
        "device=cpu",
        "draft.aux_layer_ids=[1,2,3]",
        "draft.draft_vocab_size=96",
        "draft.num_steps=2",
        "train.ttt_steps=2",
        "train.eval_k=2",
        "train.loop_eval_prompts=0",
        "train.eval_every=5",
        "train.save_every=5",
        "tracking=off",
    ]
    run(compose_cfg(*train, "train.steps=5"))
    with pytest.raises(ConfigError) as e:
        run(compose_cfg(*train, "train.steps=10", "draft.intermediate_size=96"))
    text = str(e.value)
    assert text.startswith("train.resume=True: the checkpoint in") and "train.resume=false" in text, text
    assert "intermediate_size: checkpoint 768, this run 96" in text, text
    assert "tensor midlayer.mlp.down_proj.weight: checkpoint [64, 768], this run [64, 96]" in text, text
    ctx = run(compose_cfg(*train, "train.steps=10", "draft.intermediate_size=96", "train.resume=false"))
    assert Path(ctx["draft_checkpoint"]).is_dir()  # a fresh start when asked for


def test_a_conversion_killed_midway_leaves_nothing_the_next_one_trusts(tmp_path):
    """A damaged cache (a cut model.safetensors) is converted again; SIGKILL during that conversion leaves
    its temporary folder, which the next conversion removes before it writes a whole directory."""
    from engine.loading import cache_problem, convert_gguf, gguf_cache_dir, packaged_smollm2_gguf

    gguf = packaged_smollm2_gguf()
    out = gguf_cache_dir(gguf, tmp_path)
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"\x10\x00")  # what a copy cut short leaves
    script = f"from engine.loading import *; convert_gguf(packaged_smollm2_gguf(), Path({str(tmp_path)!r}))"
    p = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not list(tmp_path.glob(f".{out.name}-*/model.safetensors")):  # mid-conversion: kill it there
        assert p.poll() is None and time.monotonic() - t0 < 300
        time.sleep(0.05)
    p.kill()
    p.wait()
    assert "is damaged (ValueError: 2 bytes: too short for a safetensors header): converting again" in p.stdout.read()
    assert not out.exists() and list(tmp_path.glob(f".{out.name}-*"))  # the temporary folder stays behind

    assert convert_gguf(gguf, tmp_path) == out
    assert cache_problem(out) is None and not list(tmp_path.glob(f".{out.name}-*"))
