"""Each draft algorithm's own config: the `draft.*` keys it reads, as a dataclass its folder declares.

Users set one flat `draft` node (pipeline/config.py: DraftConfig, the Hydra schema, so that every
conf/draft/*.yaml and override keeps one shape). `own_config` narrows it, at the edge of the draft
code, to the algorithm's dataclass (`Algorithm.config`): the plan, the checks and the draft loop read
only that, and a key the algorithm does not read, set away from its default, is one ConfigError
naming it, instead of a setting that silently does nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from engine.errors import ConfigError


@dataclass(frozen=True)
class DraftKeys:
    """What every algorithm reads."""

    algorithm: str
    num_steps: int  # k: draft tokens a round proposes


@dataclass(frozen=True)
class HeadKeys(DraftKeys):
    """What every draft with weights reads: where they come from."""

    init: str  # checkpoint | random
    path: Optional[str]  # the checkpoint directory (config.json + model.safetensors)
    init_seed: int  # random init


def own_config(cls: type, flat: Any) -> Any:
    """The flat `draft` node (a DraftConfig) narrowed to `cls`; a key outside `cls` set away from its
    default is a ConfigError. Anything else (already narrowed, a test's namespace) passes as it is."""
    if isinstance(flat, cls) or not dataclasses.is_dataclass(flat):
        return flat
    own = {f.name for f in dataclasses.fields(cls)}
    default = type(flat)()
    for f in dataclasses.fields(flat):
        value = getattr(flat, f.name)
        if f.name not in own and value != getattr(default, f.name):
            raise ConfigError(
                f"draft.{f.name}",
                value,
                f"draft.algorithm={flat.algorithm} does not read it",
                f"unset, or its keys: {', '.join('draft.' + n for n in sorted(own))}",
            )
    return cls(**{n: getattr(flat, n) for n in own})
