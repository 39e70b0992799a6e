"""Plan-time checks of `train.*` (engine/train/config.py): every bad value at once, each a ConfigError
naming the key, the value and what is valid; no weights read.

    train_problems(t, algorithm, flex, device, max_seq_len) -> [ConfigError]
"""

from __future__ import annotations

import math
import os

import torch

from engine.errors import ConfigError, check_values, raised
from engine.train.config import TrainConfig
from kernels.runtime import triton
from kernels.soft_ce import SOFT_CE_KERNELS

TRAIN_ATTENTION = ("auto", "eager", "flex")
TRAIN_KERNELS = ("auto", *SOFT_CE_KERNELS)
POSITIVE = ("steps", "ttt_steps", "max_tokens", "max_len", "eval_every", "save_every", "eval_k")
POSITIVE_DATA = ("num_samples", "batch_size", "max_prompt_tokens", "max_answer_tokens")


def _at_least(key: str, value, minimum: int = 1) -> tuple:
    """A check_values row: `value` is set and >= minimum."""
    return key, value, value is not None and value >= minimum, f">= {minimum}", "too small"


def _range(key: str, value, ok: bool, what: str, valid: str) -> list[ConfigError]:
    return [] if ok else [ConfigError(key, value, what, valid)]


def train_problems(
    t: TrainConfig, algorithm: str, flex: bool, device: torch.device, max_seq_len: int
) -> list[ConfigError]:
    """`flex`: the draft `algorithm` has a FlexAttention training forward."""
    rows = [_at_least(f"train.{k}", getattr(t, k)) for k in POSITIVE] + [
        _at_least("train.warmup_steps", t.warmup_steps, 0),
        _at_least("train.loop_eval_prompts", t.loop_eval_prompts, 0),
        _at_least("train.loop_eval_tokens", t.loop_eval_tokens),
        _at_least("train.data.min_prompt_chars", t.data.min_prompt_chars, 0),
        *(_at_least(f"train.data.{k}", getattr(t.data, k)) for k in POSITIVE_DATA),
    ]
    errors = raised(check_values, rows)
    errors += _range("train.heldout", t.heldout, 0.0 < t.heldout < 1.0, "a fraction of the samples", "0 < heldout < 1")
    n = t.data.num_samples
    errors += _range(
        "train.data.num_samples",
        n,
        n >= 2 and not (0.0 < t.heldout < 1.0 and round(n * t.heldout) >= n),
        f"too few to hold out {t.heldout:.0%} (at least one) and train on the rest",
        ">= 2, or a smaller train.heldout",
    )
    errors += _range(
        "train.attention",
        t.attention,
        t.attention in TRAIN_ATTENTION,
        "attention of the training forward",
        TRAIN_ATTENTION,
    )
    errors += _range(
        "train.attention",
        t.attention,
        t.attention != "flex" or (flex and device.type == "cuda"),
        f"FlexAttention trains {algorithm} on CUDA only (this run: {algorithm} on {device})",
        "eager or auto",
    )
    errors += _range(
        "train.kernels", t.kernels, t.kernels in TRAIN_KERNELS, "the training step's fused kernels", TRAIN_KERNELS
    )
    interpreted = device.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1"
    errors += _range(
        "train.kernels",
        t.kernels,
        t.kernels != "triton" or (triton is not None and (device.type == "cuda" or interpreted)),
        f"needs triton on CUDA (or TRITON_INTERPRET=1); this run: {device}, triton "
        f"{'installed' if triton is not None else 'not installed'}",
        "torch or auto",
    )
    errors += _range(
        "train.ema_decay",
        t.ema_decay,
        0.0 <= t.ema_decay < 1.0,
        "the decay of the exported weight average",
        "0 <= ema_decay < 1 (0: off; 0.999: about the last 1000 steps)",
    )
    errors += _range(
        "train.label_temperature",
        t.label_temperature,
        t.label_temperature > 0,
        "the temperature of the target distribution the head learns",
        "> 0 (1: the target's own)",
    )
    errors += _range(
        "train.min_lr_ratio",
        t.min_lr_ratio,
        0.0 <= t.min_lr_ratio <= 1.0,
        "where the cosine schedule ends, as a share of lr",
        "0 <= min_lr_ratio <= 1",
    )
    errors += _range("train.lr", t.lr, 0 < t.lr < math.inf, "must be positive", "> 0 and finite")
    errors += _range(
        "train.weight_decay",
        t.weight_decay,
        0.0 <= t.weight_decay < math.inf,
        "AdamW's decay of the matrices",
        ">= 0 and finite (0: off)",
    )
    errors += _range(
        "train.loss_decay",
        t.loss_decay,
        0.0 < t.loss_decay < math.inf,
        "step s of the loss weighs loss_decay ** s",
        "> 0 and finite (1: every step alike)",
    )
    errors += _range(
        "train.max_time_s",
        t.max_time_s,
        t.max_time_s is None or 0 < t.max_time_s < math.inf,
        "out of range",
        "> 0 seconds and finite, or null (train.steps alone)",
    )
    errors += _range(
        "train.max_tokens",
        t.max_tokens,
        t.max_tokens is None or t.max_len is None or t.max_tokens >= t.max_len,
        f"a batch of fewer padded tokens than one sequence of train.max_len={t.max_len}",
        f">= {t.max_len}, or a smaller train.max_len",
    )
    errors += _range(
        "train.max_len",
        t.max_len,
        t.max_len <= max_seq_len,
        f"longer than model.max_seq_len={max_seq_len}",
        f"<= {max_seq_len}",
    )
    return errors
