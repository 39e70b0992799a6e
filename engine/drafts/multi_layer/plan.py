"""Multi-layer EAGLE's plan: k = draft.num_steps modules; a checkpoint of the target's width with at least k:
a head of ours, or a target checkpoint that carries MTP layers (engine/drafts/multi_layer/public.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.drafts.base import DraftPlan, FeatureKind
from engine.drafts.checkpoint import HeadCheckpoint
from engine.drafts.common.checks import check_init, check_vocab, mlp_width, reject_width
from engine.drafts.config import HeadKeys
from engine.drafts.multi_layer.head import MultiLayerEagleHead, multi_layer_config
from engine.drafts.multi_layer.public import TargetMTPCheckpoint, declares_mtp
from engine.errors import ConfigError
from engine.model import ModelArgs


@dataclass
class MultiLayerConfig(HeadKeys):
    """draft=multi_layer_eagle (engine/drafts/config.py)."""

    algorithm: str = "multi_layer_eagle"
    # draft.init=random: each module's MLP width (null: the target's). A narrower MLP leaves room in a
    # size budget for four modules.
    intermediate_size: Optional[int] = None


def plan_multi_layer(cfg, target: ModelArgs) -> DraftPlan:
    """k = draft.num_steps modules; a checkpoint must have at least k (num_nextn_predict_layers)."""
    check_init(cfg)
    if cfg.init == "random":
        return DraftPlan(
            "multi_layer_eagle",
            FeatureKind.final,
            None,
            multi_layer_config(target, cfg.num_steps, mlp_width(cfg, target)),
        )
    if declares_mtp(cfg.path, MultiLayerEagleHead.architecture):  # a target's checkpoint with its MTP layers
        ckpt = TargetMTPCheckpoint.read(cfg.path, target, multi_layer_config)
    else:
        ckpt = HeadCheckpoint.read(cfg.path, MultiLayerEagleHead.architecture)
    reject_width(cfg, ckpt)
    check_vocab(ckpt.config, target, cfg.path)
    if ckpt.config.get("hidden_size") != target.hidden_size:
        raise ConfigError(
            "draft.path",
            cfg.path,
            f"hidden_size {ckpt.config.get('hidden_size')} differs from the target's {target.hidden_size}",
            "a head trained for this target",
        )
    modules = ckpt.config.get("num_nextn_predict_layers", 0)
    if cfg.num_steps > modules:
        raise ConfigError(
            "draft.num_steps",
            cfg.num_steps,
            f"the checkpoint has {modules} modules, one per draft token",
            f"1..{modules}",
        )
    return DraftPlan("multi_layer_eagle", FeatureKind.final, None, ckpt.config, ckpt)
