"""Exponential moving average (EMA) of a head's trainable parameters, for export and held-out evaluation.

    avg = WeightAverage(params, decay)   # float32 shadows, one per parameter (the head trains in fp32)
    avg.update(step)                     # after each optimizer step: shadow <- lerp(shadow, param, 1 - d)
    with avg.applied(): ...              # the parameters hold the average inside, their own values after
    avg.copy_to_params()                 # the parameters take the average for good (the run's end)

The decay warms up as d = min(decay, (1 + step) / (10 + step)) (the usual EMA warmup: early steps, whose
weights are far from the end's, are forgotten quickly). With decay 0.999 the average spans about the
last 1000 steps. The update is one fused `_foreach_lerp_` over all parameters: no host sync, no
per-tensor kernel launch loop in Python, negligible beside the training step.

The shadows travel with the trainer's checkpoint (`state_dict`), so a resumed run averages on exactly as
an uninterrupted one.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import Tensor


class WeightAverage:
    def __init__(self, params: Sequence[Tensor], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay}: valid 0 < decay < 1")
        self.params = list(params)
        self.decay = decay
        self.shadow = [p.detach().clone() for p in self.params]

    def rate(self, step: int) -> float:
        """The weight of the newest parameters at optimizer step `step` (0-based): 1 - the warmed-up decay."""
        return 1.0 - min(self.decay, (1.0 + step) / (10.0 + step))

    @torch.no_grad()
    def update(self, step: int) -> None:
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], self.rate(step))

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """Inside: the parameters hold the average; after: their own values again (the training goes on)."""
        own = [p.detach().clone() for p in self.params]
        torch._foreach_copy_([p.data for p in self.params], self.shadow)
        try:
            yield
        finally:
            torch._foreach_copy_([p.data for p in self.params], own)

    @torch.no_grad()
    def copy_to_params(self) -> None:
        torch._foreach_copy_([p.data for p in self.params], self.shadow)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": [s.clone() for s in self.shadow]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"EMA state of {len(state['shadow'])} tensors for {len(self.shadow)} parameters")
        torch._foreach_copy_(self.shadow, [s.to(t.device) for s, t in zip(state["shadow"], self.shadow)])
