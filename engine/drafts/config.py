"""The `draft.*` keys: each algorithm's dataclass is the Hydra schema of its own `draft=<name>` option.

    NoDraft    draft=none: no draft (k = 0); the base of every schema
    DraftKeys  what every algorithm reads: num_steps (k)
    HeadKeys   what every draft with weights reads: where they come from

A folder declares its schema (`Algorithm.config`, a subclass of these); pipeline/config.py registers
each under `schema/draft/<name>` and conf/draft/<name>.yaml extends it, so a key the algorithm does not
read, or a value of the wrong type, is Hydra's composition error, reported before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class NoDraft:
    """Plain autoregressive decoding: no draft."""

    algorithm: str = "none"  # the registry name (engine/drafts/registry.py); draft=<name> sets it

    @property
    def k(self) -> int:
        """Draft tokens a round proposes: 0 without a draft."""
        return 0


@dataclass
class DraftKeys(NoDraft):
    """What every draft algorithm reads."""

    num_steps: int = 3  # k: draft tokens proposed per verify; verify runs k + 1 positions

    @property
    def k(self) -> int:
        return self.num_steps


@dataclass
class HeadKeys(DraftKeys):
    """What every draft with weights reads: where they come from."""

    init: str = "checkpoint"  # checkpoint (config.json + model.safetensors) | random
    path: Optional[str] = None  # draft.init=checkpoint: the head's folder (conf/draft: the shipped one)
    init_seed: int = 0  # draft.init=random: the seed of the head's weights
    # sampled rounds draw the head's proposals at the request's temperature x this (lossless at any value >
    # 0); null: the head's config.json draft_temperature_factor, else 1
    temperature_factor: Optional[float] = None
