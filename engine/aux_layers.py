"""Aux hidden-state layer ids: two conventions, normalised once.

    input_of   id i is the hidden state *entering* layer i (sglang, the EAGLE reference);
               0 is the embedding output, N the last layer's output. EAGLE3 default [2, N//2, N-3].
    output_of  id i is the *output of* layer i (TensorRT-LLM, SpecForge, and the
               `eagle_config.eagle_aux_hidden_state_layer_ids` of public EAGLE3 checkpoints).

    output_of i == input_of i + 1

The engine works in `input_of`; `AuxLayers` keeps where the ids came from and shows both forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.errors import ConfigError

CONVENTIONS = ("input_of", "output_of")


@dataclass(frozen=True)
class AuxLayers:
    input_of: tuple[int, ...]
    source: str  # "config", "checkpoint" or "default"

    @property
    def output_of(self) -> tuple[int, ...]:
        return tuple(i - 1 for i in self.input_of)

    def describe(self) -> str:
        return f"input_of {list(self.input_of)} = output_of {list(self.output_of)} (from {self.source})"


def eagle3_default(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


def normalise(ids: list[int], convention: str, num_layers: int, key: str = "draft.aux_layer_ids") -> tuple[int, ...]:
    """Check `ids` in `convention` for a target of `num_layers` layers; return them as input_of."""
    if convention not in CONVENTIONS:
        raise ConfigError("draft.aux_layer_convention", convention, "unknown convention", CONVENTIONS)
    lo, hi = (0, num_layers) if convention == "input_of" else (0, num_layers - 1)
    if len(ids) == 0:
        raise ConfigError(key, list(ids), "empty", "at least one layer id")
    if len(set(ids)) != len(ids):
        raise ConfigError(key, list(ids), "duplicate layer ids", "unique ids")
    bad = [i for i in ids if not lo <= i <= hi]
    if bad:
        raise ConfigError(
            key,
            list(ids),
            f"ids {bad} out of range for a {num_layers}-layer target ({convention})",
            f"integers in [{lo}, {hi}]",
        )
    return tuple(ids) if convention == "input_of" else tuple(i + 1 for i in ids)


def resolve(
    configured: Optional[list[int]], convention: str, checkpoint_ids: Optional[list[int]], num_layers: int
) -> AuxLayers:
    """Config override > checkpoint (output_of) > EAGLE3 default (input_of)."""
    if configured is not None:
        return AuxLayers(normalise(list(configured), convention, num_layers), "config")
    if checkpoint_ids is not None:
        ids = normalise(
            list(checkpoint_ids),
            "output_of",
            num_layers,
            key="draft checkpoint eagle_config.eagle_aux_hidden_state_layer_ids",
        )
        return AuxLayers(ids, "checkpoint")
    default = eagle3_default(num_layers)
    if len(set(default)) != len(default) or min(default) < 0:
        raise ConfigError(
            "draft.aux_layer_ids",
            None,
            f"the EAGLE3 default [2, N//2, N-3] = {list(default)} is not valid for a {num_layers}-layer target",
            "explicit unique ids",
        )
    return AuxLayers(default, "default")
