"""Token sampling: greedy, or temperature with nucleus (top-p) filtering, per batch or per row.

    logits [batch, vocab] -> tokens [batch] int64

Sampling draws with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which equals a draw
from p, needs no host sync, and takes an explicit `torch.Generator` so runs are reproducible.

Two ways to say how a batch samples:

    SamplingParams   one setting for every row (eval: one prompt set, one setting)
    RowSampling      the per-row form the draft-and-verify round uses. `RowSampling.uniform(params)`
                     keeps scalars (bit-identical to the batch-wide path); `RowSampling.per_row(...)`
                     gives each row its own temperature / top-p / generator (serve: every request its
                     own). Greedy rows (temperature 0) stay exactly greedy: the argmax, never a draw.

Random numbers of a row come from that row's own generator when it has one (a request with a
`seed`), else from the batch's shared generator. A seeded row therefore draws the same numbers
whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from kernels.top_p import top_p_filter


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 256
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class RowSampling:
    """How each row of a batch picks tokens. Scalars apply to every row; tensors are per row."""

    temperature: float | Tensor  # scalar, or [b, 1] float32 (greedy rows hold 1.0: never divided by 0)
    top_p: float | Tensor  # scalar, or [b, 1] float32
    greedy: bool | Tensor  # every row greedy (bool), or [b] bool
    any_sampled: bool  # host-side: some row draws (no device sync to find out)
    any_top_p: bool  # host-side: some row filters by top-p
    generator: Optional[torch.Generator] = None  # shared by rows without their own
    row_generators: tuple[tuple[int, torch.Generator], ...] = ()  # (row, generator) of seeded rows

    @classmethod
    def uniform(cls, params: SamplingParams, generator: Optional[torch.Generator] = None) -> "RowSampling":
        return cls(
            params.temperature,
            params.top_p,
            params.greedy,
            not params.greedy,
            not params.greedy and params.top_p < 1.0,
            generator,
        )

    @classmethod
    def per_row(
        cls,
        temperature: Sequence[float],
        top_p: Sequence[float],
        generators: Sequence[Optional[torch.Generator]],
        device,
        shared: Optional[torch.Generator] = None,
    ) -> "RowSampling":
        greedy = [t <= 0.0 for t in temperature]
        temps = [1.0 if g else t for t, g in zip(temperature, greedy)]
        tops = [1.0 if g else p for p, g in zip(top_p, greedy)]
        return cls(
            torch.tensor(temps, dtype=torch.float32, device=device)[:, None],
            torch.tensor(tops, dtype=torch.float32, device=device)[:, None],
            torch.tensor(greedy, dtype=torch.bool, device=device),
            any_sampled=not all(greedy),
            any_top_p=any(p < 1.0 for p in tops),
            generator=shared,
            row_generators=tuple(
                (i, g) for i, (g, gr) in enumerate(zip(generators, greedy)) if g is not None and not gr
            ),
        )

    @property
    def all_greedy(self) -> bool:
        return not self.any_sampled

    def head(self, b: int) -> "RowSampling":
        """The settings of the first b rows (a round over fewer rows than the batch holds)."""
        if not isinstance(self.greedy, Tensor) or self.greedy.shape[0] == b:
            return self
        greedy = self.greedy[:b]
        gens = tuple((i, g) for i, g in self.row_generators if i < b)
        any_sampled = bool((~greedy).any())  # a host sync, once per change of the batch's rows
        return RowSampling(
            self.temperature[:b],
            self.top_p[:b],
            greedy,
            any_sampled,
            any_sampled and bool((self.top_p[:b] < 1.0).any()),
            self.generator,
            gens,
        )

    def repeat_rows(self, n: int) -> "RowSampling":
        """Each row's setting n times ([b] -> [b * n]): for [b, n, vocab] logits viewed as [b * n, vocab]."""
        rep = lambda x: x.repeat_interleave(n, 0) if isinstance(x, Tensor) else x  # noqa: E731
        return RowSampling(
            rep(self.temperature),
            rep(self.top_p),
            rep(self.greedy),
            self.any_sampled,
            self.any_top_p,
            self.generator,
            (),
        )

    # -- random numbers: shared generator, then each seeded row redrawn from its own ---------------
    def rand(self, b: int, k: int, device) -> Tensor:
        """[b, k] uniform in [0, 1)."""
        u = torch.rand(b, k, device=device, generator=self.generator)
        for i, g in self.row_generators:
            u[i] = torch.rand(k, device=device, generator=g)
        return u

    def race(self, probs: Tensor) -> Tensor:
        """One draw per row of [b, vocab] probabilities (exponential race: no host sync)."""
        e = torch.empty_like(probs).exponential_(1.0, generator=self.generator)
        for i, g in self.row_generators:
            e[i].exponential_(1.0, generator=g)
        return (probs / e).argmax(-1)


def probs_from_logits(
    logits: Tensor, temperature: float | Tensor, top_p: float | Tensor, any_top_p: Optional[bool] = None
) -> Tensor:
    """[batch, vocab] logits -> [batch, vocab] float32 probabilities after temperature and top-p.

    temperature / top_p: scalars, or [batch, 1] per row. any_top_p: whether a row filters (host-side,
    so per-row top-p needs no sync to decide); None: decided from a scalar top_p."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if any_top_p is None:
        any_top_p = isinstance(top_p, Tensor) or top_p < 1.0
    if any_top_p:  # the smallest set of the likeliest tokens whose mass reaches top_p (kernels/top_p.py)
        probs = top_p_filter(probs, top_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def as_rows(params: SamplingParams | RowSampling, generator: Optional[torch.Generator] = None) -> RowSampling:
    return params if isinstance(params, RowSampling) else RowSampling.uniform(params, generator)


def sample(logits: Tensor, params: SamplingParams | RowSampling, generator: Optional[torch.Generator] = None) -> Tensor:
    """logits [batch, vocab] -> next tokens [batch]."""
    s = as_rows(params, generator)
    greedy = logits.argmax(dim=-1)
    if s.all_greedy:
        return greedy
    drawn = s.race(probs_from_logits(logits, s.temperature, s.top_p, s.any_top_p))
    return drawn if isinstance(s.greedy, bool) else torch.where(s.greedy, greedy, drawn)


def draft_draw(
    logits: Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None
) -> tuple[Tensor, Optional[Tensor]]:
    """A draft's proposal from its logits [..., vocab] -> (ids [...], probs [..., vocab] or None).

    Greedy: the argmax, no probs (verification treats the draft as one-hot). Else a draw from the
    draft's own temperature / top-p distribution q, returned with q for rejection sampling."""
    if params.greedy:
        return logits.argmax(-1), None
    q = probs_from_logits(logits, params.temperature, params.top_p)  # [..., vocab]
    race = torch.empty_like(q).exponential_(1.0, generator=generator)
    return (q / race).argmax(-1), q
