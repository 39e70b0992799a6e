"""The target's training forward replayed from CUDA graphs: one graph per batch shape class.

A training step runs the frozen target over the batch (its features and label logits), then the head's
forward and backward. The target's eager forward launches about ten kernels a layer from Python; with
the draft's packed step the host's launching, not the device, bounds the step, and the device idles
between kernels. Replayed from a graph, the target's forward is one launch.

Batches are length-bucketed (engine/train/data.py `batches`): their shapes are known before training
and the same every epoch. Each (rows, width) shape of a set is put in a class by its width rounded up to
`WIDTH_STEP`; a class's bucket holds the most rows any of its batches has (under torchrun, a rank's parts
of the training batches and rank 0's whole held-out batches are two sets, so a part replays a graph of a
part's rows). A batch replays the smallest bucket that holds it, over the bucket's static buffers;
padding rows and columns are invalid (written to the cache's dummy slot, never read by a valid query:
the attention is causal over fresh rows). The runner (engine/graphs/runner.py) copies the inputs in and
clones the outputs out:

    in   tokens, positions [b, t] int64, valid [b, t] bool, logits_index [b] int64
    out  ForwardOutput: hidden [b, t, hidden], aux [b, t, hidden * n_aux], logits [b, 1, vocab]

policy: "full" (CUDA: one graph a bucket, SDPA's causal kernel captured) or "debug" (the same buffers,
padding and slicing replayed eagerly: the CPU stand-in the tests run).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from engine.graphs.runner import TARGET_OUT, CaptureHiddenMode, GraphRunner, InputSpec, token_inputs
from engine.model import ForwardOutput, StaticKVCache

WIDTH_STEP = 16  # a class's widths: padding costs the device at most WIDTH_STEP - 1 columns a row


def width_buckets(shapes: Iterable[tuple[int, int]], step: int = WIDTH_STEP) -> list[tuple[int, int]]:
    """(rows, width) of each batch -> (rows, width) buckets: each width rounded up to `step`, with the
    most rows of any batch in that class."""
    rows: dict[int, int] = {}
    for r, w in shapes:
        t = -(-w // step) * step
        rows[t] = max(rows.get(t, 0), r)
    return sorted((r, t) for t, r in rows.items())


class TargetGraphs:
    """The target's training forward over `cache`'s fresh rows, one graph per bucket of each shape set."""

    def __init__(
        self, target, cache: StaticKVCache, shape_sets: Iterable[Iterable[tuple[int, int]]], policy: str = "full"
    ):
        buckets = sorted({(r, min(t, cache.max_seq_len)) for s in shape_sets for r, t in width_buckets(s)})
        if max(r for r, _ in buckets) > cache.batch_size:
            raise ValueError(f"a batch of {max(r for r, _ in buckets)} rows exceeds the cache's {cache.batch_size}")
        device = target.lm_head.weight.device
        self.runner = GraphRunner(
            "train_target",
            policy,
            lambda b: target.program(cache.rows(b), logits_at_index=True, causal=True),
            {**token_inputs(), "logits_index": InputSpec((), torch.long, 0, per_row=True)},
            TARGET_OUT,
            CaptureHiddenMode.FULL,
            buckets,
            device,
            cache.max_seq_len,
            lambda: {"aux_layer_ids": target.aux_layer_ids},
            torch.cuda.graph_pool_handle() if policy != "debug" else None,
        ).capture()

    @property
    def stats(self):
        return self.runner.stats

    def __call__(self, tokens: Tensor, positions: Tensor, valid: Tensor, logits_index: Tensor) -> ForwardOutput:
        live = {"tokens": tokens, "positions": positions, "valid": valid, "logits_index": logits_index}
        out, _ = self.runner(live, tokens.shape[1], CaptureHiddenMode.FULL)
        return ForwardOutput.from_env(out)
