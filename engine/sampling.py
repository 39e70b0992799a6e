"""How rows pick tokens: greedy, or temperature with nucleus (top-p) filtering, each row its own setting and seed.

    SamplingParams   one setting for a whole prompt set (eval)
    RowSettings      per row: temperature (0: greedy), top_p, seed, speculate. The host writes them into a
                     round's state buffers when rows start (engine/speculative/generate.py, `SpecDecoder.start`); the
                     round's kernels read them there, so a captured sampled round needs no host input
    Draws            those buffers' rows, as a device program passes them to `draw`
    draw(...)        tokens from logits [b, t, V] (kernels/sample.py: the exponential race over Philox noise
                     of (seed, position, stream, vocabulary index)), by the kernels or their reference

Random numbers are a function of (row seed, absolute position, stream, vocabulary index) only: a seeded
row draws the same tokens whatever batch it is in (kernels/sample.py says why reusing positions across
rounds is unbiased). Seeds: `row_seed(base, i)` (eval: the run's seed and the prompt's index, so the
output does not depend on eval.batch_size), `seeds_from(generator, n)`, or a request's own (`as_seed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from kernels.sample import BONUS, DRAFT, sample, sample_reference

__all__ = ["BONUS", "DRAFT", "Draws", "RowSettings", "SamplingParams", "as_seed", "draw", "row_seed", "seeds_from"]
_SEED_BUFFERS = ("temperature", "top_p", "seed", "speculate")  # the round's state buffers RowSettings fills


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 256
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def as_seed(x: int) -> int:
    """Any integer as a signed 64-bit seed (its low 64 bits): the Philox key of kernels/sample.py."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def row_seed(base: int, index: int) -> int:
    """Row `index`'s seed under a run's `base` seed (splitmix64 of both: nearby values, unrelated keys)."""
    return as_seed(_splitmix64(_splitmix64(base & ((1 << 64) - 1)) ^ index))


def seeds_from(generator: Optional[torch.Generator], n: int) -> list[int]:
    """n seeds drawn from a generator (advancing it); None: from torch's default generator."""
    device = generator.device if generator is not None else "cpu"
    return torch.randint(-(2**63), 2**63 - 1, (n,), generator=generator, device=device).tolist()


@dataclass(frozen=True)
class RowSettings:
    """Each row's sampling, on the host: written into a round's state buffers when the rows start."""

    temperature: Sequence[float]  # 0 (or less): greedy
    top_p: Sequence[float]
    seed: Sequence[int]
    speculate: Sequence[bool]  # False: the row takes no draft token (its output is plain decoding's)

    @classmethod
    def uniform(cls, params: SamplingParams, seeds: Sequence[int], speculate: bool = True) -> "RowSettings":
        n = len(seeds)
        return cls([params.temperature] * n, [params.top_p] * n, list(seeds), [speculate] * n)

    @property
    def sampled(self) -> list[bool]:
        return [t > 0 for t in self.temperature]

    def write(self, buffers: dict[str, Tensor], rows: slice) -> None:
        """Into the round's per-row buffers temperature [B], top_p [B], seed [B], speculate [B], at `rows`."""
        values = (
            [max(t, 0.0) for t in self.temperature],
            list(self.top_p),
            [as_seed(s) for s in self.seed],
            list(self.speculate),
        )
        for name, vals in zip(_SEED_BUFFERS, values):
            buf = buffers[name]
            buf[rows] = torch.tensor(vals, dtype=buf.dtype).to(buf.device, non_blocking=True)


@dataclass(frozen=True)
class Draws:
    """The per-row sampling state a device program reads: views of the round's buffers, [b] each."""

    temperature: Tensor  # fp32, 0: greedy
    top_p: Tensor  # fp32
    seed: Tensor  # int64

    def rows(self, sl: slice) -> "Draws":
        return Draws(self.temperature[sl], self.top_p[sl], self.seed[sl])


def draw(
    logits: Tensor,
    draws: Draws,
    pos0: Tensor,
    stream: int,
    *,
    kernels: bool,
    offset: int = 0,
    index: Optional[Tensor] = None,
    q_out: Optional[Tensor] = None,
    offsets: Optional[Tensor] = None,
) -> Tensor:
    """logits [b, t, V] -> ids [b, t] (index [b]: [b, 1]) drawn at positions pos0 + offset (+ the t-index):
    kernels/sample.py's `sample` (kernels=True: the Triton kernels, else the plain-torch reference). Greedy
    rows take the argmax exactly; q_out [b, t or 1, V] receives the sampled rows' distribution (a draft's
    q); offsets map draft ids to target ids (d2t)."""
    fn = sample if kernels else sample_reference
    t, p, s = draws.temperature, draws.top_p, draws.seed
    return fn(logits, t, p, s, pos0, stream, offset=offset, index=index, q_out=q_out, offsets=offsets)
