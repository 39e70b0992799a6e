"""EAGLE's plan: no aux layers (it reads the target's final hidden state); a checkpoint's vocabulary and fc
width (token embedding + final hidden state)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.drafts.base import DraftPlan, FeatureKind
from engine.drafts.checkpoint import HeadCheckpoint
from engine.drafts.common.checks import check_fc, check_init, check_vocab
from engine.drafts.config import HeadKeys
from engine.drafts.eagle.head import EagleHead, eagle_config
from engine.model import ModelArgs


@dataclass
class EagleConfig(HeadKeys):
    """draft=eagle: the common keys of a draft with weights (engine/drafts/config.py)."""

    algorithm: str = "eagle"


def plan_eagle(cfg, target: ModelArgs) -> DraftPlan:
    check_init(cfg)
    if cfg.init == "random":
        return DraftPlan("eagle", FeatureKind.final, None, eagle_config(target))
    ckpt = HeadCheckpoint.read(cfg.path, EagleHead.architecture)
    check_vocab(ckpt.config, target, cfg.path)
    check_fc(ckpt, 2 * target.hidden_size, f"token embedding {target.hidden_size} + final hidden {target.hidden_size}")
    return DraftPlan("eagle", FeatureKind.final, None, ckpt.config, ckpt)
