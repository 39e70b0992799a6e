"""Data-parallel draft training across processes (torchrun): the process group and the few collectives.

    torchrun --nproc_per_node=N -m pipeline +experiment=train_eagle3_smollm2

torchrun starts N copies of the pipeline and sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and
MASTER_ADDR/PORT in each. `launch()` reads them; with WORLD_SIZE > 1, `process_group(device)` joins the
group for the run (nccl on CUDA, each rank on cuda:LOCAL_RANK; gloo on CPU) and leaves it at the end, on
failure too. Outside a group every helper here is the one-process identity, so the trainer and the stage
run unchanged in a single process.

What each rank does (stages/train_draft.py, engine/train/trainer.py):
    data      rank r synthesises its share of train.data.num_samples from its own slice of the seeds,
              writes a shard; after a barrier rank 0 joins the shards (rank order) into the cached data
              set and every rank reads that same set back: same split, same batches, same order
    step      every batch (a list of samples) is dealt out, rank r taking samples r, r + N, ...; each part
              is padded to the whole batch's width and to the largest part's rows (copies that train
              nothing), so every rank meets the same shapes at the same step, and the target's training
              graphs hold a part's rows, not the batch's. Each rank weighs its loss by its share of the
              batch's trained tokens, and `sum_gradients` adds the gradients up: the gradient of the whole
              batch's mean loss, as one process would get it. The clip, AdamW and the EMA then run on
              identical gradients, so every rank keeps identical weights
    clock     with train.max_time_s, rank 0's elapsed time is broadcast each step (the LR schedule and the
              stop read it), so every rank stops at the same step
    rank 0    alone logs to MLflow, evaluates, prints progress and writes checkpoints and the head
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Launch:
    """What torchrun set for this process (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launch() -> Launch:
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return Launch(
        int(env.get("RANK", "0")),
        world,
        int(env.get("LOCAL_RANK", "0")),
        int(env.get("LOCAL_WORLD_SIZE", str(world))),
    )


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """Inside: this process is in the group torchrun described (nothing to do for one process); the
    group is destroyed on the way out, whatever happens inside. SIGTERM (torchrun stopping the workers
    when one of them failed) raises SystemExit, so the MLflow run is marked FAILED, not left RUNNING."""
    if not launch().distributed or dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend(device), device_id=device if device.type == "cuda" else None)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        dist.destroy_process_group()


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def quiet_unless_main() -> Iterator[None]:
    """Ranks other than 0 print nothing (each stage's progress lines would repeat once per rank); their
    errors and warnings still reach stderr."""
    if rank() == 0:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        yield


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shard(items: Sequence, r: int | None = None, n: int | None = None) -> list:
    """Rank r's part of `items`: items r, r + n, ... (length-sorted batches stay balanced in width)."""
    r, n = (rank() if r is None else r), (world_size() if n is None else n)
    return list(items[r::n])


def share(total: int, r: int | None = None, n: int | None = None) -> int:
    """Rank r's count when `total` is dealt out over n ranks (the first total % n get one more)."""
    r, n = (rank() if r is None else r), (world_size() if n is None else n)
    return total // n + (r < total % n)


def sum_across(x: Tensor) -> Tensor:
    """x summed over the ranks (x itself in one process); x is left as it was."""
    if not dist.is_initialized():
        return x
    out = x.detach().clone()
    dist.all_reduce(out)
    return out


def token_mean(tokens: int, values: dict[str, float]) -> dict[str, float]:
    """Each key's mean over the ranks' `values`, weighed by their `tokens` (a rank without tokens adds
    nothing; rank 0 always has some), on every rank. Host floats: for the logged figures, not per step."""
    if not dist.is_initialized():
        return dict(values)
    rows: list = [None] * world_size()
    dist.all_gather_object(rows, (tokens, values))
    total = max(sum(n for n, _ in rows), 1)
    return {k: sum(n * v[k] for n, v in rows if n) / total for k in rows[0][1]}


def from_main(value: float, device: torch.device) -> float:
    """Rank 0's `value` on every rank (a clock, a decision)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    return float(t.item())


@torch.no_grad()
def broadcast_params(params: Sequence[Tensor]) -> None:
    """Every rank takes rank 0's values (the start of training: identical weights, whatever the init)."""
    if dist.is_initialized():
        for p in params:
            dist.broadcast(p.data, 0)


@torch.no_grad()
def sum_gradients(params: Sequence[Tensor]) -> None:
    """p.grad <- its sum over the ranks, in one flat all_reduce. A rank without a gradient for p (no
    samples in its part of the batch) adds zeros; p keeps no gradient only where no rank had one, as in
    one process (AdamW then skips it)."""
    if not dist.is_initialized() or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    had = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=grads[0].device)
    flat = torch.cat([g.flatten() for g in grads] + [had])  # [sum of numels + len(params)]
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n
    for p, h in zip(params, flat[offset:].tolist()):
        if h == 0:
            p.grad = None
