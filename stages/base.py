"""The stage contract and the stage registry.

A stage is a class registered under a name with

    requires   keys of the run context it reads (provided by earlier stages)
    provides   keys it writes
    needed(cfg, draft)  whether a run of `cfg` (draft: its DraftPlan or None) has this stage in its plan
    check(cfg, env)   static validation from config files alone (no weights, no GPU); raises ConfigError
    run(cfg, inputs, env) -> {key: value for key in provides}
    kv_rows(cfg)      a final stage's (key, rows): the largest KV cache it allocates (the plan's memory check)

`final = True` marks a stage that can end a plan (`task=eval`, `serve`, `train_draft`); `runs_target = True`
a stage that runs target forwards (eval, serve, capture_graphs), which the plan puts after
`configure_aux_capture` whenever the draft reads aux layers. The runner
(`pipeline.execute`) hands each stage only what it requires and checks that it returned exactly what it
provides, so the contract the plan validated is the contract that runs.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch

from engine.drafts.registry import DraftPlan
from engine.model import ModelArgs
from schema import RunConfig


def device_name(device: Optional[torch.device]) -> str:
    """The device in words (MLflow's `device` tag, a model card's "trained on")."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


@dataclass
class StageEnv:
    """What every stage may use besides its inputs: resolved device/dtype, paths, the tracker."""

    device: torch.device
    dtype: torch.dtype
    outputs_dir: Path
    target_args: ModelArgs  # from config files, before any weight is read
    draft_plan: Optional[DraftPlan] = None  # None: no draft
    tracker: Any = None  # pipeline.tracking.Tracker (None at plan time)
    notes: list[str] = field(default_factory=list)  # plan remarks shown by dry_run
    command: Optional[list[str]] = None  # the job's command-line overrides (a model card's command); None: unknown

    @property
    def weights_dir(self) -> Path:
        return self.outputs_dir / "weights"


class Stage:
    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    optional: ClassVar[tuple[str, ...]] = ()  # read when an earlier stage provided them (e.g. graphs)
    provides: ClassVar[tuple[str, ...]] = ()
    final: ClassVar[bool] = False
    runs_target: ClassVar[bool] = False  # runs target forwards: aux capture must be configured first

    @classmethod
    def needed(cls, cfg: RunConfig, draft: Optional[DraftPlan]) -> bool:
        """Whether the plan of `cfg` runs this stage (a final stage: when it is the task)."""
        return cfg.task == cls.name if cls.final else True

    def kv_rows(self, cfg: RunConfig) -> tuple[str, int]:
        """A final stage's (key, rows) of the largest KV cache it allocates (model.max_seq_len slots a row)."""
        raise NotImplementedError

    def check(self, cfg: RunConfig, env: StageEnv) -> None:
        """Raise engine.errors.ConfigError on a bad config; read no weights."""

    def describe(self, cfg: RunConfig, env: StageEnv) -> str:
        """One line for the dry-run plan."""
        return ""

    def run(self, cfg: RunConfig, inputs: dict[str, Any], env: StageEnv) -> dict[str, Any]:
        raise NotImplementedError

    def inputs(self, context: dict[str, Any]) -> dict[str, Any]:
        """What `run` gets from what earlier stages provided: every required key, the optional ones present."""
        return {k: context[k] for k in self.requires} | {k: context[k] for k in self.optional if k in context}


STAGES: dict[str, type[Stage]] = {}


def register_stage(cls: type[Stage]) -> type[Stage]:
    if cls.name in STAGES:
        raise ValueError(f"stage {cls.name!r} registered twice")
    STAGES[cls.name] = cls
    return cls


def final_stages() -> list[str]:
    return sorted(n for n, s in STAGES.items() if s.final)
