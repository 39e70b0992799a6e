"""EAGLE3's plan: aux layer ids (config > checkpoint > default), the checkpoint's target width, fc width and
vocabulary, or a random head's draft vocabulary and lm_head; and its words in the plan line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine import aux_layers
from engine.drafts.base import DraftPlan, FeatureKind
from engine.drafts.checkpoint import HeadCheckpoint
from engine.drafts.common.checks import check_fc, check_init, check_target_fit, mlp_width, reject_width
from engine.drafts.config import HeadKeys
from engine.drafts.eagle3.head import Eagle3Head, eagle3_config
from engine.errors import ConfigError
from engine.model import ModelArgs


@dataclass
class Eagle3Config(HeadKeys):
    """draft=eagle3 (engine/drafts/config.py)."""

    algorithm: str = "eagle3"
    # Target layers whose hidden states feed the draft. null: the checkpoint's
    # eagle_config.eagle_aux_hidden_state_layer_ids (output_of), else [2, N//2, N-3] (input_of).
    aux_layer_ids: Optional[list[int]] = None
    aux_layer_convention: str = "input_of"  # input_of (sglang, EAGLE) | output_of (TensorRT-LLM, SpecForge)
    draft_vocab_size: Optional[int] = None  # draft.init=random: reduced draft vocabulary (null: the target's)
    # draft.init=random: own (an lm_head of the head's own over draft_vocab_size tokens) | target (the
    # target's lm_head, shared and frozen: the whole vocabulary, nothing stored; draft_vocab_size null)
    lm_head: str = "own"
    # draft.init=random: the draft layer's MLP width (null: the target's). A narrower MLP leaves room in
    # a size budget for a larger draft vocabulary.
    intermediate_size: Optional[int] = None


LM_HEADS = ("own", "target")  # draft.lm_head of a random-init EAGLE3 head


def plan_eagle3(cfg, target: ModelArgs) -> DraftPlan:
    check_init(cfg)
    ckpt, ckpt_ids = None, None
    if cfg.init == "checkpoint":
        ckpt = HeadCheckpoint.read(cfg.path, Eagle3Head.architecture)
        ckpt_ids = (ckpt.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        reject_width(cfg, ckpt)
        check_target_fit(ckpt.config, target, cfg.path)
    aux = aux_layers.resolve(cfg.aux_layer_ids, cfg.aux_layer_convention, ckpt_ids, target.num_layers)
    n = len(aux.input_of)
    if ckpt is not None:
        check_fc(ckpt, n * target.hidden_size, f"{n} aux layers x target hidden {target.hidden_size}")
        head_cfg = {
            **ckpt.config,
            "eagle_config": {
                **ckpt.config.get("eagle_config", {}),
                "eagle_aux_hidden_state_layer_ids": list(aux.output_of),
            },
        }
    else:
        dv = cfg.draft_vocab_size
        if dv is not None and not 0 < dv <= target.vocab_size:
            raise ConfigError("draft.draft_vocab_size", dv, "out of range", f"1..{target.vocab_size}, or null")
        if cfg.lm_head not in LM_HEADS:
            raise ConfigError("draft.lm_head", cfg.lm_head, "where the head's logits come from", LM_HEADS)
        if cfg.lm_head == "target" and dv is not None:
            raise ConfigError(
                "draft.draft_vocab_size",
                dv,
                "draft.lm_head=target predicts over the target's whole vocabulary",
                "null (or draft.lm_head=own)",
            )
        head_cfg = eagle3_config(target, list(aux.output_of), dv, cfg.lm_head, mlp_width(cfg, target))
    return DraftPlan("eagle3", FeatureKind.aux, aux, head_cfg, ckpt)


def describe_eagle3(plan: DraftPlan) -> list[str]:
    """Its draft vocabulary (or the target's lm_head) and its MLP width."""
    cfg = plan.head_config
    vocab = f"draft vocab {cfg['draft_vocab_size']}" if "draft_vocab_size" in cfg else None
    return [vocab or "the target's lm_head (whole vocabulary)", f"MLP {cfg['intermediate_size']}"]
