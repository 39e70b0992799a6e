"""DFlash's plan: explicit target layer ids (config > checkpoint, never a default), block size and mask
token from the config or the checkpoint, num_steps within the block, fc width against the aux layers,
the context window (config > checkpoint); and its words in the plan line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine import aux_layers
from engine.drafts.base import DraftPlan, FeatureKind, vocab_details
from engine.drafts.checkpoint import HeadCheckpoint
from engine.drafts.common.checks import (
    check_fc,
    check_init,
    check_target_fit,
    kv_heads,
    mlp_width,
    reject_random_only,
    reject_width,
)
from engine.drafts.config import HeadKeys
from engine.drafts.dflash.head import (
    SLIDING,
    WINDOW_KEYS,
    DFlashHead,
    context_window,
    dflash_config,
    dflash_value,
    window_keys,
)
from engine.errors import ConfigError
from engine.model import ModelArgs


@dataclass
class DFlashConfig(HeadKeys):
    """draft=dflash (engine/drafts/config.py)."""

    algorithm: str = "dflash"
    # Target layers injected as keys and values: no default, these or the checkpoint's
    # dflash_config.target_layer_ids.
    aux_layer_ids: Optional[list[int]] = None
    aux_layer_convention: str = "input_of"  # input_of (sglang, EAGLE) | output_of (TensorRT-LLM, SpecForge)
    # Tokens per block (the bonus token + block_size - 1 mask tokens; num_steps <= block_size - 1), the
    # mask token (an id of the target vocabulary) and the drafter's decoder layers. null: the
    # checkpoint's; with draft.init=random: num_steps + 1, the target's last token id, 1 layer.
    block_size: Optional[int] = None
    mask_token_id: Optional[int] = None
    num_layers: Optional[int] = None
    intermediate_size: Optional[int] = None  # draft.init=random: the layers' MLP width (null: the target's)
    # draft.init=random: the drafter's key/value heads (null: the target's; a divisor of its query heads).
    # The context reaches a block only through each layer's keys and values: more heads widen that path.
    num_kv_heads: Optional[int] = None
    # The context window of each block query, in positions (a Hugging Face `sliding_attention` layer: a
    # query at position p reads context positions > p - sliding_window). null: the checkpoint's (none
    # with draft.init=random); 0: no window. A drafter trained on short samples loses its way over
    # contexts longer than it saw; the window keeps it within them.
    sliding_window: Optional[int] = None


def spread_ids(num_layers: int, n: int = 5) -> list[int]:
    """n target layers spread over the depth (input_of), for an error message's example."""
    return sorted({round(1 + i * (num_layers - 2) / (n - 1)) for i in range(n)}) if num_layers > 2 else [1]


def plan_window(cfg, ck: dict, block: int) -> int:
    """The context window (0: none): draft.sliding_window, else the checkpoint's. A checkpoint's layers
    are all full attention or all non-causal sliding attention; the window covers the block and the
    anchor's last context position (a query at the block's end is block_size positions past it)."""
    types = ck.get("layer_types")
    if types and (set(types) - {"full_attention"}) and (set(types) != {SLIDING} or ck.get("is_causal", True)):
        raise ConfigError(
            "draft.path",
            cfg.path,
            f"its layer_types {types} (is_causal {ck.get('is_causal')}): this drafter runs every layer alike, "
            "non-causal inside the block",
            "a checkpoint whose layers are all full_attention, or all sliding_attention with is_causal false",
        )
    window = cfg.sliding_window if cfg.sliding_window is not None else context_window(ck)
    if window and window <= block:  # a negative window too
        raise ConfigError(
            "draft.sliding_window",
            window,
            f"a window counts the positions a query reads: at the end of a block of {block} tokens it must "
            "reach back to the anchor's context position",
            f"> {block} (the block size), or 0 / null for no window",
        )
    return window


def plan_dflash(cfg, target: ModelArgs) -> DraftPlan:
    """Target layer ids are explicit (config > checkpoint, never a default), block size and mask token
    from the config or the checkpoint, num_steps within the block, fc width against the aux layers."""
    check_init(cfg)
    ckpt, ck = None, {}
    if cfg.init == "checkpoint":
        ckpt = HeadCheckpoint.read(cfg.path, DFlashHead.architecture)
        ck = ckpt.config
        check_target_fit(ck, target, cfg.path)
    n_layers = target.num_layers
    ckpt_ids = dflash_value(ck, "target_layer_ids")
    if cfg.aux_layer_ids is not None:
        aux = aux_layers.AuxLayers(
            aux_layers.normalise(list(cfg.aux_layer_ids), cfg.aux_layer_convention, n_layers), "config"
        )
    elif ckpt_ids is not None:
        aux = aux_layers.AuxLayers(
            aux_layers.normalise(
                list(ckpt_ids), "output_of", n_layers, key="draft checkpoint dflash_config.target_layer_ids"
            ),
            "checkpoint",
        )
    else:
        raise ConfigError(
            "draft.aux_layer_ids",
            None,
            "draft.algorithm=dflash has no default target layers: "
            "they must be explicit (configured before graph capture, like EAGLE3's)",
            f"unique ids in [0, {n_layers}] (input_of) for this {n_layers}-layer target, e.g. "
            f"{spread_ids(n_layers)}, or a checkpoint with dflash_config.target_layer_ids",
        )
    n_aux = len(aux.input_of)

    block = cfg.block_size or dflash_value(ck, "block_size") or cfg.num_steps + 1
    if block < 2:
        raise ConfigError("draft.block_size", block, "a block holds the bonus token and at least one mask", ">= 2")
    if cfg.num_steps > block - 1:
        raise ConfigError(
            "draft.num_steps",
            cfg.num_steps,
            f"a block of draft.block_size={block} tokens proposes at most {block - 1}",
            f"1..{block - 1}, or a larger draft.block_size",
        )
    mask = dflash_value(ck, "mask_token_id")
    if ckpt is not None and cfg.mask_token_id is not None and cfg.mask_token_id != mask:
        raise ConfigError(
            "draft.mask_token_id",
            cfg.mask_token_id,
            f"the checkpoint was trained with mask_token_id={mask}",
            f"null or {mask}",
        )
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else mask
    mask = target.vocab_size - 1 if mask is None else mask
    if not 0 <= mask < target.vocab_size:
        raise ConfigError(
            "draft.mask_token_id", mask, "not an id of the target vocabulary", f"0..{target.vocab_size - 1}"
        )
    window = plan_window(cfg, ck, block)
    if ckpt is not None:
        layers = ck.get("num_hidden_layers")
        if cfg.num_layers is not None and cfg.num_layers != layers:
            raise ConfigError(
                "draft.num_layers", cfg.num_layers, f"the checkpoint has {layers} layers", f"null or {layers}"
            )
        check_fc(ckpt, n_aux * target.hidden_size, f"{n_aux} aux layers x target hidden {target.hidden_size}")
        reject_width(cfg, ckpt)
        reject_random_only(cfg, ckpt, "num_kv_heads", "num_key_value_heads", "key/value head count")
        settings = {"target_layer_ids": list(aux.output_of), "block_size": block, "mask_token_id": mask}
        head_cfg = {
            **{k: v for k, v in ck.items() if k not in WINDOW_KEYS},
            "block_size": block,
            "mask_token_id": mask,
            "dflash_config": {**(ck.get("dflash_config") or {}), **settings},
            **window_keys(layers, window),
        }
    else:
        layers = cfg.num_layers if cfg.num_layers is not None else 1
        if layers < 1:
            raise ConfigError("draft.num_layers", layers, "the drafter needs a decoder layer", ">= 1")
        head_cfg = dflash_config(
            target, list(aux.output_of), block, mask, layers, mlp_width(cfg, target), kv_heads(cfg, target), window
        )
    return DraftPlan("dflash", FeatureKind.aux, aux, head_cfg, ckpt)


def describe_dflash(plan: DraftPlan) -> list[str]:
    cfg = plan.head_config
    return [
        f"block {cfg['block_size']} (mask token {cfg['mask_token_id']}), {cfg['num_hidden_layers']} layers",
        f"MLP {cfg['intermediate_size']}, {cfg['num_key_value_heads']} kv heads",
        f"context window {w}" if (w := context_window(cfg)) else "whole context",
        *vocab_details(plan),
    ]
