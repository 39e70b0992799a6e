"""The draft-training loop: AdamW, warmup + cosine LR, bf16 autocast on CUDA, held-out evaluation,
checkpoints in the public format, resume, a wall-clock budget.

    Trainer(head, target, train, heldout, vocab, cfg, out_dir, log, spec, seed).fit() -> final held-out metrics

`cfg` is the run's `train` config (engine/train/config.py) as it is; its `auto` choices (attention,
kernels) are resolved here, against the algorithm and the device (`train_attention`, `train_kernels`).

`spec` (engine/drafts/train_contract.py's TrainSpec, from the draft's folder) is how the algorithm trains: its
forward, features and loss; everything else here is the same for every draft.

Checkpoint layout (`out_dir/checkpoint/`): the head as `config.json` + `model.safetensors` (loads like
any EAGLE3 checkpoint) and `trainer_state.pt` (optimizer, step, epoch, position in the epoch, RNG),
written aside, fsynced and sealed before it replaces the last one (engine/train/checkpoints.py), so a kill
at any point leaves one complete. `resume=True` continues from the newest complete one: same batch order,
same LR schedule; one trained with other draft settings is a ConfigError naming them.

With `ema_decay` the held-out evaluations read an exponential moving average of the weights, and the run
ends with the head holding it; the last step's own weights stay in `last_weights` (and their held-out
figures come back prefixed `last_`), so one run compares the two.

The head trains in float32 (master weights); the target runs in the run's dtype. Only the head's own
parameters train: the token embedding is the target's and stays frozen.

Under torchrun (engine/train/distributed.py) every rank runs this loop on its part of each batch, the
gradients summed so that all ranks step alike; rank 0 alone evaluates, logs, shows progress and saves.
The split is exact: a rank's loss is weighed by its share of the batch's trained tokens, and every TTT
step trains the same positions (a chat-templated prompt is longer than train.ttt_steps), so the summed
gradient is the whole batch's, as one process computes it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from engine.drafts.checkpoint import HeadCheckpoint
from engine.drafts.common.ttt import TRITON_OPS
from engine.drafts.train_contract import TrainSpec
from engine.errors import ConfigError
from engine.model import StaticKVCache
from engine.train import checkpoints, distributed
from engine.train.acceptance import chain_acceptance, chain_lengths, simulated_loop
from engine.train.average import WeightAverage
from engine.train.config import TrainConfig
from engine.train.data import VocabMap, batch_width, batches, target_batch
from engine.train.selfdistill import Sample
from engine.train.target_graphs import TargetGraphs
from kernels.runtime import triton

GRAD_CLIP = 0.5  # the gradient's global norm is clipped to this


def train_attention(setting: str, spec: TrainSpec, device: torch.device) -> str:
    """train.attention with auto resolved: FlexAttention where the draft has a flex forward on CUDA."""
    if setting == "auto":
        return "flex" if spec.flex and device.type == "cuda" else "eager"
    return setting


def train_kernels(setting: str, device: torch.device) -> str:
    """train.kernels with auto resolved: the fused Triton kernels on CUDA where triton is installed."""
    if setting == "auto":
        return "triton" if device.type == "cuda" and triton is not None else "torch"
    return setting


def training_forward(spec: TrainSpec, attention: str, kernels: str) -> Callable:
    """The training step's forward: the draft's packed forward (train.attention=flex, where it has one:
    only the trained positions, per-step objective.Rows), else its forward with FlexAttention
    (train.attention=flex) and the Triton RMSNorm and RoPE (train.kernels=triton) where it has them.
    Evaluation keeps the plain forward (the materialized attention: no backward there)."""
    options = {"ops": TRITON_OPS} if kernels == "triton" and spec.forward_ops else {}
    if attention == "flex" and spec.packed_forward is not None:
        return functools.partial(spec.packed_forward, **options)
    if attention == "flex" and spec.flex_attention is not None:
        options["attention"] = spec.flex_attention
    return functools.partial(spec.forward, **options)


def lr_at(step: int, elapsed_s: float, s: TrainConfig) -> float:
    """Linear warmup, then cosine to lr * min_lr_ratio over the run's progress: the larger of steps done
    and, with a time budget, time used, so a run stopped by `max_time_s` still ends on a decayed LR."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    frac = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    if s.max_time_s:
        frac = max(frac, elapsed_s / s.max_time_s)
    floor = s.min_lr_ratio
    return s.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


class Trainer:
    def __init__(
        self,
        head,
        target,
        train: list[Sample],
        heldout: list[Sample],
        vocab: VocabMap,
        settings: TrainConfig,
        out_dir: Path,
        log: Callable[[dict, int], None],
        spec: TrainSpec,
        seed: int = 0,
    ):
        self.spec, self.seed = spec, seed
        self.head, self.target, self.s, self.out_dir, self.log = head, target, settings, out_dir, log
        self.train_samples, self.heldout = train, heldout
        self.vocab = vocab
        self.device = target.lm_head.weight.device
        self.attention = train_attention(settings.attention, spec, self.device)
        self.kernels = train_kernels(settings.kernels, self.device)
        # (rows, width) of every batch, the same each epoch: a rank's part of a training batch (its rows
        # padded to rank 0's, the largest part), a whole held-out one (rank 0 evaluates alone)
        at = settings.max_tokens, settings.max_len, None
        parts = [(distributed.share(len(g), 0), batch_width(g, settings.max_len)) for g in batches(train, *at)]
        whole = [(len(g), batch_width(g, settings.max_len)) for g in batches(heldout, *at)]
        rows = max(r for r, _ in parts + whole)
        self.cache = StaticKVCache(target.args, rows, settings.max_len, self.device, target.lm_head.weight.dtype)
        # on CUDA the target's forward replays from graphs: its eager launches would bound the step
        # one process: one shape set; under torchrun the held-out batches get buckets of their own
        sets = [parts + whole] if distributed.world_size() == 1 else [parts, whole]
        self.graphs = TargetGraphs(target, self.cache, sets) if self.device.type == "cuda" else None
        self.params = [p for p in head.parameters() if p.requires_grad]
        distributed.broadcast_params(self.params)  # every rank starts from rank 0's weights (and EMA)
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings.lr,
            betas=(0.9, 0.95),
            fused=self.device.type == "cuda",
        )
        # no trainable parameters (a frozen head, evaluated only): nothing to average
        self.ema = WeightAverage(self.params, settings.ema_decay) if settings.ema_decay > 0 and self.params else None
        self.last_weights: Optional[list[torch.Tensor]] = None  # with ema: the last step's own weights, at the end
        self.step, self.epoch, self.index = 0, 0, 0
        self.start_metrics: dict[str, float] = {}  # held-out figures at step 0 (none when resumed past it)
        self.elapsed_s = 0.0  # training time so far, across resumes
        self._order: tuple[int, list[list[Sample]]] = (-1, [])
        self.train_forward = training_forward(spec, self.attention, self.kernels)
        self.loss = functools.partial(spec.loss, kernel=self.kernels)  # (logits, batch, decay)

    # -- state ------------------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.out_dir / "checkpoint"

    def save(self) -> None:
        def fill(tmp: Path) -> None:
            self.head.save(tmp)
            state = {
                "optimizer": self.opt.state_dict(),
                "step": self.step,
                "epoch": self.epoch,
                "index": self.index,
                "elapsed_s": self.elapsed_s,
                "rng": torch.get_rng_state(),
                "ema": self.ema.state_dict() if self.ema is not None else None,
            }
            torch.save(state, tmp / "trainer_state.pt")

        checkpoints.write(self.out_dir, self.step, fill)

    def resume(self) -> bool:
        """Load the newest complete checkpoint if there is one; True when training continues from it. One
        whose head differs from this run's (a changed draft setting) is a ConfigError naming the keys."""
        path = checkpoints.newest(self.out_dir)
        if path is None:
            return False
        ckpt = HeadCheckpoint.read(str(path), self.head.architecture)
        if diff := checkpoints.mismatch(ckpt.config, ckpt.shapes, self.head):
            raise ConfigError(
                "train.resume",
                True,
                f"the checkpoint in {path} was trained with other settings ({diff})",
                "the settings it was trained with, or train.resume=false to start afresh (overwriting it)",
            )
        ckpt.load_into(self.head)
        state = torch.load(path / "trainer_state.pt", map_location=self.device, weights_only=False)
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.epoch, self.index = state["step"], state["epoch"], state["index"]
        self.elapsed_s = state.get("elapsed_s", 0.0)
        if self.ema is not None and state.get("ema") is not None:
            self.ema.load_state_dict(state["ema"])
        torch.set_rng_state(state["rng"].cpu())
        return True

    # -- loop -------------------------------------------------------------------------------------
    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _batch(
        self,
        samples: list[Sample],
        label_temperature: float = 1.0,
        width: Optional[int] = None,
        rows: Optional[int] = None,
    ):
        return target_batch(
            self.target,
            self.cache,
            samples,
            self.vocab,
            self.s.max_len,
            self.device,
            self.spec.features,
            label_temperature=label_temperature,
            graphs=self.graphs,
            width=width,
            rows=rows,
        )

    def _epoch_order(self) -> list[list[Sample]]:
        if self._order[0] != self.epoch:
            self._order = (
                self.epoch,
                batches(self.train_samples, self.s.max_tokens, self.s.max_len, self.seed + self.epoch),
            )
        return self._order[1]

    def _clock(self, t0: float) -> float:
        """Training seconds so far, read once a step; with a time budget, rank 0's on every rank (the LR
        schedule and the stop read it, so all ranks step alike and stop at the same step)."""
        elapsed = time.perf_counter() - t0
        return distributed.from_main(elapsed, self.device) if self.s.max_time_s is not None else elapsed

    def _backward(self, group: list[Sample]) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
        """Forward and backward on this rank's part of the batch `group` -> (its loss, its stats, its trained
        tokens, the whole batch's). The loss backpropagated is weighed by the rank's share of the tokens, so
        the gradients summed over the ranks are the whole batch's mean loss's (one process: the loss itself)."""
        mine = distributed.shard(group)
        if not mine:  # fewer samples than ranks: this rank adds no gradient
            own = torch.zeros((), dtype=torch.long, device=self.device)
            return torch.zeros((), device=self.device), {}, own, distributed.sum_across(own)
        # every rank's part as wide as the whole batch and of as many rows as the largest part: the same
        # shapes on every rank, so the ranks compile FlexAttention for a new shape at the same step instead
        # of in turn (a rank's extra rows are copies that train nothing)
        width, rows = batch_width(group, self.s.max_len), distributed.share(len(group), 0)  # rank 0's: the largest
        batch = self._batch(mine, self.s.label_temperature, width, rows)
        with self._autocast():
            logits = self.train_forward(self.head, batch, self.s.ttt_steps)
        loss, stats = self.loss(logits, batch, self.s.loss_decay)
        own = batch.mask.sum()
        if distributed.world_size() == 1:
            loss.backward()
            return loss, stats, own, own
        tokens = distributed.sum_across(own)
        (loss * (own / tokens.clamp(min=1))).backward()  # a batch without trained tokens: no gradient
        return loss, stats, own, tokens

    def evaluate(self) -> dict[str, float]:
        """Held-out figures of the weights the run exports: the EMA with ema_decay, else the weights."""
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
            return self._evaluate()

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        """Held-out loss, per-step accuracy, and chain acceptance at eval_k drafts."""
        self.head.eval()
        k = self.s.eval_k
        accepted, anchors, loss, tokens = torch.zeros(k), 0, 0.0, 0
        loop_tokens = loop_rounds = covered = 0
        acc = [0.0] * self.s.ttt_steps
        for group in batches(self.heldout, self.s.max_tokens, self.s.max_len, None):
            batch = self._batch(group)
            with self._autocast():
                logits = self.spec.forward(self.head, batch, max(self.s.ttt_steps, k))
            batch_loss, stats = self.loss(logits[: self.s.ttt_steps], batch, self.s.loss_decay)
            n = batch.num_tokens
            loss, tokens = loss + batch_loss.item() * n, tokens + n
            covered += int(((batch.top >= 0) & batch.mask).sum())  # the target's token is a draft token
            for s in range(self.s.ttt_steps):
                acc[s] += stats[f"acc_{s}"].item() * n if f"acc_{s}" in stats else 0.0
            length = chain_lengths(logits, batch, k)  # [B, T], once for both estimates
            a, m = chain_acceptance(length, batch.mask, min(k, len(logits)))
            accepted[: len(a)] += a.cpu().float()
            anchors += int(m)
            n_tok, n_rounds, _ = simulated_loop(length, batch.mask, self.s.loop_eval_tokens)
            loop_tokens, loop_rounds = loop_tokens + n_tok, loop_rounds + n_rounds
        self.head.train()
        out = {
            "val_loss": loss / max(tokens, 1),
            f"val_accept_length_k{k}": 1.0 + float(accepted.sum()) / max(anchors, 1),
            f"val_loop_accept_length_k{k}": loop_tokens / max(loop_rounds, 1),
            "val_draft_vocab_coverage": covered / max(tokens, 1),
        }
        out.update({f"val_acc_{s}": acc[s] / max(tokens, 1) for s in range(self.s.ttt_steps)})
        out.update({f"val_accept_rate_pos_{i}": float(accepted[i]) / max(anchors, 1) for i in range(k)})
        return out

    def fit(self, resume: bool = False) -> dict[str, float]:
        s = self.s
        main = distributed.is_main()
        if resume and self.resume() and main:
            print(f"[train_draft] resumed from {self.ckpt_dir} at step {self.step}", flush=True)
        self.head.train()
        t0, last_log = time.perf_counter() - self.elapsed_s, time.perf_counter()
        metrics = self.evaluate() if self.step == 0 and main else {}
        if metrics:
            self.log(metrics, 0)
            self.start_metrics = metrics  # the untrained head's figures: what training is measured against
        bar = tqdm(
            total=s.steps, initial=self.step, desc="train_draft", unit="step", dynamic_ncols=True, disable=not main
        )
        tokens_seen = 0
        stopped_early = False
        while self.step < s.steps:
            order = self._epoch_order()
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            lr = lr_at(self.step, self.elapsed_s, s)  # on the clock of the last step's end (or the resume)
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.opt.zero_grad(set_to_none=True)
            loss, stats, own, tokens = self._backward(order[self.index])
            distributed.sum_gradients(self.params)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, GRAD_CLIP)
            self.opt.step()
            if self.ema is not None:
                self.ema.update(self.step)
            self.step, self.index = self.step + 1, self.index + 1
            tokens_seen += tokens
            bar.update(1)
            if self.step % 10 == 0 or self.step == s.steps:
                now = time.perf_counter()
                # the whole batch's figures: each rank's weighed by its trained tokens
                own_figures = {"loss": loss.item(), **{k: v.item() for k, v in stats.items()}}
                figures = distributed.token_mean(int(own), own_figures)
                row = {
                    "train_loss": figures.pop("loss"),
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "epoch": self.epoch,
                    "train_tokens_per_s": int(tokens_seen) / max(now - last_log, 1e-9),
                    **{f"train_{k}": v for k, v in figures.items()},
                }
                tokens_seen, last_log = 0, now
                if not math.isfinite(row["train_loss"]):  # stop at once: every step after it trains on NaN
                    raise FloatingPointError(
                        f"train_draft: train_loss={row['train_loss']} at step {self.step} (grad_norm "
                        f"{row['grad_norm']}, lr {lr:g}, train.kernels={self.kernels}); valid: a finite loss. "
                        f"Try a lower train.lr, or train.kernels=torch to rule out the Triton kernels"
                    )
                self.log(row, self.step)
                bar.set_postfix(loss=f"{row['train_loss']:.3f}", acc0=f"{row['train_acc_0']:.2f}")
            if self.step % s.eval_every == 0 and self.step < s.steps and main:
                metrics = self.evaluate()
                self.log(metrics, self.step)
            if self.step % s.save_every == 0 and main:
                self.save()
            self.elapsed_s = self._clock(t0)
            if s.max_time_s is not None and self.elapsed_s > s.max_time_s:
                stopped_early = True
                break
        bar.close()
        if not main:  # the other ranks' part ends with the last step: rank 0 evaluates, saves and exports
            return {"train_steps": self.step, "train_s": self.elapsed_s, "train_stopped_by_time": float(stopped_early)}
        metrics = self.evaluate()
        self.save()  # the raw weights and the average: a resumed run continues from here
        if self.ema is not None:  # end on the average; the last step's weights for comparison
            metrics.update({f"last_{k}": v for k, v in self._evaluate().items()})
            self.last_weights = [p.detach().clone() for p in self.params]
            self.ema.copy_to_params()
        metrics["train_steps"] = self.step
        metrics["train_s"] = self.elapsed_s
        metrics["train_stopped_by_time"] = float(stopped_early)
        self.log(metrics, self.step)
        return metrics
