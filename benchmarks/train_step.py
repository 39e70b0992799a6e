"""Where a draft-training step's time goes: `python benchmarks/train_step.py [overrides...]`.

Builds the plan of `+experiment=train_eagle3_smollm2` (plus overrides), runs its load and aux-capture
stages, then times the target's pass (causal SDPA against the engine's decode attention) and one
training step phase by phase (target features, head forward, loss, backward, optimizer) on synthetic
samples of the given shapes (random ids: the cost does not depend on the text),
for every forward variant in `--variants`: eager (materialized attention scores), flex (FlexAttention's
compiled kernel, what `train.attention=auto` picks on CUDA), flex_fused_loss (flex with the Triton
loss but the torch norms and RoPE), flex_torch_kernels (flex with the plain-torch loss, norms and RoPE
instead of the recipe's `train.kernels`, auto: the Triton ones on CUDA), compile (torch.compile of the
eager forward and loss, dynamic shapes; not a trainer option: see docs/benchmarks.md). Prints one row per
(variant, shape) and, with --profile, the top kernels of three whole training steps (flex: target
features, forward, loss, backward, optimizer).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import time

import torch

from engine.drafts.common.ttt import TORCH_OPS
from engine.drafts.registry import train_spec
from engine.train.data import VocabMap, target_batch
from engine.train.selfdistill import Sample
from engine.train.trainer import Trainer, train_forward_options
from pipeline.config import compose_run_config
from pipeline.plan import build_plan
from stages.train_draft import settings


def samples(n: int, length: int, vocab: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    return [
        Sample("", [rng.randrange(vocab) for _ in range(40)], [rng.randrange(vocab) for _ in range(length - 40)])
        for _ in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32x512,64x256", help="rows x length per batch")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--variants", default="eager,flex,compile")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = compose_run_config("+experiment=train_eagle3_smollm2", "tracking=off", *args.overrides)
    plan = build_plan(cfg)
    ctx = plan.set_up("load", "configure_aux_capture")
    target, head = ctx["target"].model, ctx["draft_head"]
    spec = train_spec(cfg.draft.algorithm)
    dev = target.lm_head.weight.device
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    data = {s: samples(s[0], s[1], target.args.vocab_size, i) for i, s in enumerate(shapes)}
    student = head.copy(dev, torch.float32).requires_grad_(True)
    if spec.prepare is not None:  # EAGLE3: its draft vocabulary
        spec.prepare(student, (x.ids for v in data.values() for x in v), sorted(set(target.args.eos_token_ids)))
    vocab = VocabMap.of(student)
    s = settings(cfg, dev)
    everything = [x for v in data.values() for x in v]  # sizes the target's KV rows for every shape
    trainer = Trainer(
        student, target, everything, everything, vocab, s, plan.env.outputs_dir / "bench", lambda *a, **k: None, spec
    )
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def forward_loss(attention="eager", kernels=s.kernels, ops=None):  # the recipe's kernels unless named
        o = train_forward_options(spec, dataclasses.replace(s, attention=attention, kernels=kernels))
        fwd = functools.partial(spec.forward, **(o | ({"ops": ops} if ops else {})))
        return lambda h, batch: spec.loss(fwd(h, batch, s.ttt_steps), batch, s.loss_decay, kernel=kernels)

    variants = {
        "eager": forward_loss(),
        "flex": forward_loss("flex"),
        "flex_fused_loss": forward_loss("flex", ops=TORCH_OPS),
        "flex_torch_kernels": forward_loss("flex", "torch"),
    }
    if "compile" in args.variants:
        variants["compile"] = torch.compile(forward_loss(kernels="torch"), dynamic=True)
    for shape in shapes:  # the target's pass: one causal SDPA (what training uses) against its decode attention
        ms = {}
        for causal in (True, False):
            for it in range(args.iters + 1):
                if it == 1:
                    sync()
                    t0 = time.perf_counter()
                target_batch(target, trainer.cache, data[shape], vocab, s.max_len, dev, spec.features, causal=causal)
            sync()
            ms[causal] = (time.perf_counter() - t0) * 1e3 / args.iters
        print(
            f"target features {shape[0]}x{shape[1]}: causal SDPA {ms[True]:.1f} ms, the engine's attention "
            f"{ms[False]:.1f} ms",
            flush=True,
        )
    print(
        f"{'variant':8} {'shape':>7} {'first s':>8} {'target':>8} {'fwd+loss':>9} {'bwd':>8} {'opt':>8} "
        f"{'step ms':>8} {'k tok/s':>8} {'peak GB':>8}"
    )
    for name, fn in variants.items():
        if name not in args.variants.split(","):
            continue
        for shape in shapes:
            torch.cuda.reset_peak_memory_stats() if dev.type == "cuda" else None
            times = {"target": 0.0, "fwd": 0.0, "bwd": 0.0, "opt": 0.0}
            t_first = time.perf_counter()
            for it in range(args.iters + 2):
                if it == 1:
                    sync()
                    first = time.perf_counter() - t_first
                marks = [time.perf_counter()]
                batch = trainer._batch(data[shape])
                sync()
                marks.append(time.perf_counter())
                with trainer._autocast():
                    loss, _ = fn(student, batch)
                sync()
                marks.append(time.perf_counter())
                trainer.opt.zero_grad(set_to_none=True)
                loss.backward()
                sync()
                marks.append(time.perf_counter())
                torch.nn.utils.clip_grad_norm_(trainer.params, s.grad_clip)
                trainer.opt.step()
                sync()
                marks.append(time.perf_counter())
                if it >= 2:
                    for key, a, b in zip(times, marks, marks[1:]):
                        times[key] += (b - a) * 1e3 / args.iters
            step = sum(times.values())
            peak = torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else 0.0
            print(
                f"{name:8} {shape[0]:>3}x{shape[1]:<3} {first:8.1f} {times['target']:8.1f} {times['fwd']:9.1f} "
                f"{times['bwd']:8.1f} {times['opt']:8.1f} {step:8.1f} {shape[0] * shape[1] / step:8.1f} {peak:8.1f}",
                flush=True,
            )
    if args.profile and dev.type == "cuda":  # the whole training step as the trainer runs it on CUDA (flex)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                batch = trainer._batch(data[shapes[0]])
                with trainer._autocast():
                    loss, _ = variants["flex"](student, batch)
                trainer.opt.zero_grad(set_to_none=True)
                loss.backward()
                trainer.opt.step()
            sync()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))


if __name__ == "__main__":
    main()
