"""The draft registry: one entry per algorithm, planned from config files and built at run time.

    plan_draft(cfg, target_args)  -> DraftPlan     config.json + safetensors header only: aux layer
                                                   ids (config > checkpoint > default), fc width check
    load_head(plan, target, ...)  -> head | None   weights (or random init), sharing target storage
    make_draft(plan, head, ...)   -> Draft | None  per-eval draft object (its own KV cache)

An entry (`DraftSpec`) names the three: `plan`, the `head` class built from `DraftPlan.head_config`
(None for weightless drafts), and `make`, which builds the per-run Draft object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from engine import aux_layers
from engine.drafts.base import Draft, FeatureKind
from engine.drafts.dflash import DFlashDraft, DFlashHead, dflash_config, dflash_value
from engine.drafts.feature import FeatureDraft
from engine.drafts.heads import Eagle3Head, EagleHead, HeadCheckpoint, eagle3_config, eagle_config
from engine.drafts.lookup import NgramDraft, OracleDraft
from engine.drafts.multi_layer import MultiLayerEagleHead, make_multi_layer, multi_layer_config
from engine.errors import ConfigError
from engine.model import LlamaModel, ModelArgs, init_normal_

INITS = ("checkpoint", "random")
LM_HEADS = ("own", "target")  # draft.lm_head of a random-init EAGLE3 head
# The shipped recipe that trains each algorithm's head (conf/experiment/train_<...>.yaml).
TRAIN_RECIPES = {
    "eagle3": "+experiment=train_eagle3_smollm2",
    "multi_layer_eagle": "+experiment=train_mtp_smollm2",
    "dflash": "+experiment=train_dflash_smollm2",
    "eagle": "+experiment=train_eagle_smollm2",
}


@dataclass(frozen=True)
class DraftPlan:
    algorithm: str
    features: FeatureKind
    aux: Optional[aux_layers.AuxLayers] = None  # EAGLE3: the target layers to capture
    head_config: Optional[dict] = None  # EAGLE-family: the head's config.json
    checkpoint: Optional[HeadCheckpoint] = None

    @property
    def random_weights(self) -> bool:
        """A draft with weights (EAGLE family, multi-layer, DFlash) and no checkpoint: random init."""
        return self.checkpoint is None and self.head_config is not None

    def random_weights_warning(self) -> str:
        recipe = TRAIN_RECIPES[self.algorithm]
        return (
            f"the {self.algorithm} head has RANDOM WEIGHTS (draft.init=random): its accept_length and speedup "
            f"measure plumbing and timing, not the algorithm. Train one with `python -m pipeline {recipe}`, "
            "or point draft.path at a trained checkpoint with draft.init=checkpoint"
        )

    def describe(self) -> str:
        parts = [self.algorithm]
        if self.checkpoint is not None:
            parts.append(f"checkpoint {self.checkpoint.path}")
        elif self.head_config is not None:
            parts.append("RANDOM-WEIGHT head")
        if self.head_config is not None and "block_size" in self.head_config:
            parts.append(
                f"block {self.head_config['block_size']} (mask token {self.head_config['mask_token_id']}), "
                f"{self.head_config['num_hidden_layers']} layers"
            )
        if self.head_config is not None and "draft_vocab_size" in self.head_config:
            parts.append(f"draft vocab {self.head_config['draft_vocab_size']}")
        elif self.algorithm == "eagle3":
            parts.append("the target's lm_head (whole vocabulary)")
        if self.algorithm == "eagle3" and self.head_config is not None:
            parts.append(f"MLP {self.head_config['intermediate_size']}")
        if self.aux is not None:
            parts.append(f"aux layers {self.aux.describe()}")
        return ", ".join(parts)


@dataclass(frozen=True)
class DraftContext:
    """What `DraftSpec.make` may use to build a run's Draft object."""

    target: LlamaModel
    batch_size: int
    k: int  # draft tokens per round (draft.num_steps)
    cfg: Any = None  # pipeline.config.DraftConfig
    references: Optional[list[list[int]]] = None  # the baseline's outputs (oracle)
    prompt_lens: Optional[list[int]] = None


@dataclass(frozen=True)
class DraftSpec:
    plan: Callable[[Any, ModelArgs], DraftPlan]  # what the draft reads is DraftPlan.features
    make: Callable[[DraftPlan, Optional[torch.nn.Module], DraftContext], Draft]
    head: Optional[type] = None  # the head class built from DraftPlan.head_config
    needs_baseline: bool = False  # the oracle reads the baseline's outputs


def _check_init(cfg) -> None:
    if cfg.init not in INITS:
        raise ConfigError("draft.init", cfg.init, "unknown", INITS)
    if cfg.init == "checkpoint" and not cfg.path:
        raise ConfigError(
            "draft.path",
            cfg.path,
            f"draft.algorithm={cfg.algorithm} with draft.init=checkpoint needs a checkpoint directory",
            "a checkpoint directory, or draft.init=random",
        )


def _check_fc(ckpt: HeadCheckpoint, expected: int, why: str) -> None:
    shape = ckpt.shapes.get("fc.weight")
    if shape is None:
        raise ConfigError("draft.path", str(ckpt.path), "no fc.weight in the checkpoint", "an EAGLE-family head")
    if shape[1] != expected:
        raise ConfigError(
            "draft.path",
            str(ckpt.path),
            f"fc.weight takes {shape[1]} inputs, but the target provides {expected} ({why})",
            f"a head whose fc takes {expected} inputs, or draft.aux_layer_ids with {shape[1]} // target hidden layers",
        )


def _mlp_width(cfg, target: ModelArgs) -> Optional[int]:
    """draft.intermediate_size of a random head: its layers' MLP width (None: the target's)."""
    width = cfg.intermediate_size
    if width is not None and width < 1:
        raise ConfigError(
            "draft.intermediate_size",
            width,
            "the draft layers' MLP width",
            f">= 1, or null (the target's {target.intermediate_size})",
        )
    return width


def _reject_width(cfg, ckpt: HeadCheckpoint) -> None:
    if cfg.intermediate_size is not None:
        raise ConfigError(
            "draft.intermediate_size",
            cfg.intermediate_size,
            f"a checkpoint's MLP width is its config.json's ({ckpt.config.get('intermediate_size')})",
            "null (or draft.init=random)",
        )


def _reject_aux_ids(cfg) -> None:
    """Drafts that read the target's final hidden state take no aux layer ids."""
    if cfg.aux_layer_ids is not None:
        raise ConfigError(
            "draft.aux_layer_ids",
            list(cfg.aux_layer_ids),
            f"draft.algorithm={cfg.algorithm} reads the target's final hidden state, not aux layers",
            "null (draft.algorithm=eagle3 or dflash read aux layers)",
        )


def _check_vocab(cfg_json: dict, target: ModelArgs, path) -> None:
    if cfg_json.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ConfigError(
            "draft.path",
            str(path),
            f"vocab_size {cfg_json['vocab_size']} differs from the target's {target.vocab_size}",
            "a head trained for this target",
        )


def _plan_eagle3(cfg, target: ModelArgs) -> DraftPlan:
    _check_init(cfg)
    ckpt, ckpt_ids = None, None
    if cfg.init == "checkpoint":
        ckpt = HeadCheckpoint.read(cfg.path, Eagle3Head.architecture)
        ckpt_ids = (ckpt.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        _reject_width(cfg, ckpt)
        th = ckpt.config.get("target_hidden_size", ckpt.config.get("hidden_size"))
        if th != target.hidden_size:
            raise ConfigError(
                "draft.path",
                cfg.path,
                f"target_hidden_size {th} differs from the target's hidden size {target.hidden_size}",
                "a head trained for this target",
            )
        _check_vocab(ckpt.config, target, cfg.path)
    aux = aux_layers.resolve(cfg.aux_layer_ids, cfg.aux_layer_convention, ckpt_ids, target.num_layers)
    n = len(aux.input_of)
    if ckpt is not None:
        _check_fc(ckpt, n * target.hidden_size, f"{n} aux layers x target hidden {target.hidden_size}")
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
        head_cfg = eagle3_config(target, list(aux.output_of), dv, cfg.lm_head, _mlp_width(cfg, target))
    return DraftPlan("eagle3", FeatureKind.aux, aux, head_cfg, ckpt)


def _plan_eagle(cfg, target: ModelArgs) -> DraftPlan:
    _check_init(cfg)
    _reject_aux_ids(cfg)
    if cfg.init == "random":
        return DraftPlan("eagle", FeatureKind.final, None, eagle_config(target))
    ckpt = HeadCheckpoint.read(cfg.path, EagleHead.architecture)
    _check_vocab(ckpt.config, target, cfg.path)
    _check_fc(ckpt, 2 * target.hidden_size, f"token embedding {target.hidden_size} + final hidden {target.hidden_size}")
    return DraftPlan("eagle", FeatureKind.final, None, ckpt.config, ckpt)


def _plan_multi_layer_eagle(cfg, target: ModelArgs) -> DraftPlan:
    """k = draft.num_steps modules; a checkpoint must have at least k (num_nextn_predict_layers)."""
    _check_init(cfg)
    _reject_aux_ids(cfg)
    if cfg.init == "random":
        return DraftPlan(
            "multi_layer_eagle",
            FeatureKind.final,
            None,
            multi_layer_config(target, cfg.num_steps, _mlp_width(cfg, target)),
        )
    ckpt = HeadCheckpoint.read(cfg.path, MultiLayerEagleHead.architecture)
    _reject_width(cfg, ckpt)
    _check_vocab(ckpt.config, target, cfg.path)
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


def _plan_weightless(name: str) -> Callable[[Any, ModelArgs], DraftPlan]:
    return lambda cfg, target: DraftPlan(name, FeatureKind.none)


def _spread_ids(num_layers: int, n: int = 5) -> list[int]:
    """n target layers spread over the depth (input_of), for an error message's example."""
    return sorted({round(1 + i * (num_layers - 2) / (n - 1)) for i in range(n)}) if num_layers > 2 else [1]


def _plan_dflash(cfg, target: ModelArgs) -> DraftPlan:
    """Target layer ids are explicit (config > checkpoint, never a default), block size and mask token
    from the config or the checkpoint, num_steps within the block, fc width against the aux layers."""
    _check_init(cfg)
    ckpt, ck = None, {}
    if cfg.init == "checkpoint":
        ckpt = HeadCheckpoint.read(cfg.path, DFlashHead.architecture)
        ck = ckpt.config
        th = ck.get("target_hidden_size", ck.get("hidden_size"))
        if th != target.hidden_size:
            raise ConfigError(
                "draft.path",
                cfg.path,
                f"target_hidden_size {th} differs from the target's hidden size {target.hidden_size}",
                "a head trained for this target",
            )
        _check_vocab(ck, target, cfg.path)
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
            f"{_spread_ids(n_layers)}, or a checkpoint with dflash_config.target_layer_ids",
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
    if ckpt is not None:
        layers = ck.get("num_hidden_layers")
        if cfg.num_layers is not None and cfg.num_layers != layers:
            raise ConfigError(
                "draft.num_layers", cfg.num_layers, f"the checkpoint has {layers} layers", f"null or {layers}"
            )
        _check_fc(ckpt, n_aux * target.hidden_size, f"{n_aux} aux layers x target hidden {target.hidden_size}")
        settings = {"target_layer_ids": list(aux.output_of), "block_size": block, "mask_token_id": mask}
        head_cfg = {
            **ck,
            "block_size": block,
            "mask_token_id": mask,
            "dflash_config": {**(ck.get("dflash_config") or {}), **settings},
        }
    else:
        layers = cfg.num_layers if cfg.num_layers is not None else 1
        if layers < 1:
            raise ConfigError("draft.num_layers", layers, "the drafter needs a decoder layer", ">= 1")
        head_cfg = dflash_config(target, list(aux.output_of), block, mask, layers)
    return DraftPlan("dflash", FeatureKind.aux, aux, head_cfg, ckpt)


def _make_dflash(plan: DraftPlan, head, ctx: DraftContext) -> Draft:
    return DFlashDraft(head, ctx.batch_size, ctx.k)


def _make_feature(plan: DraftPlan, head, ctx: DraftContext) -> Draft:
    return FeatureDraft(head, ctx.batch_size, ctx.k, plan.features)


def _plan_ngram(cfg, target: ModelArgs) -> DraftPlan:
    if not 1 <= cfg.ngram_min <= cfg.ngram_max:
        raise ConfigError(
            "draft.ngram_min",
            cfg.ngram_min,
            f"must be in [1, draft.ngram_max={cfg.ngram_max}]",
            "1 <= ngram_min <= ngram_max",
        )
    return DraftPlan("ngram", FeatureKind.none)


def _make_ngram(plan: DraftPlan, head, ctx: DraftContext) -> Draft:
    return NgramDraft(ctx.cfg.ngram_max, ctx.cfg.ngram_min)


def _make_oracle(plan: DraftPlan, head, ctx: DraftContext) -> Draft:
    if ctx.references is None:
        raise RuntimeError("the oracle draft needs the baseline's outputs (eval.baseline=true)")
    return OracleDraft(ctx.references, ctx.prompt_lens)


DRAFTS: dict[str, DraftSpec] = {
    "eagle3": DraftSpec(_plan_eagle3, _make_feature, Eagle3Head),
    "eagle": DraftSpec(_plan_eagle, _make_feature, EagleHead),
    "multi_layer_eagle": DraftSpec(_plan_multi_layer_eagle, make_multi_layer, MultiLayerEagleHead),
    "ngram": DraftSpec(_plan_ngram, _make_ngram),
    "oracle": DraftSpec(_plan_weightless("oracle"), _make_oracle, needs_baseline=True),
    "dflash": DraftSpec(_plan_dflash, _make_dflash, DFlashHead),
}
ALGORITHMS = ("none", *DRAFTS)


def plan_draft(cfg, target: ModelArgs) -> Optional[DraftPlan]:
    if cfg.algorithm == "none":
        return None
    if cfg.algorithm not in DRAFTS:
        raise ConfigError("draft.algorithm", cfg.algorithm, "unknown draft algorithm", ALGORITHMS)
    if cfg.num_steps < 1:
        raise ConfigError("draft.num_steps", cfg.num_steps, "a draft proposes at least one token", ">= 1")
    return DRAFTS[cfg.algorithm].plan(cfg, target)


def load_head(plan: Optional[DraftPlan], target: LlamaModel, seed: int, device, dtype) -> Optional[torch.nn.Module]:
    """The EAGLE-family head on device, sharing the target's embedding (and lm_head for EAGLE)."""
    if plan is None or plan.head_config is None:
        return None
    head = DRAFTS[plan.algorithm].head(plan.head_config, target.max_seq_len)
    head = plan.checkpoint.load_into(head) if plan.checkpoint is not None else init_normal_(head, seed)
    head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    head.init_buffers(device)
    return head.bind(target)


def make_draft(
    plan: Optional[DraftPlan],
    head,
    target: LlamaModel,
    batch_size: int,
    k: int,
    *,
    references: Optional[list[list[int]]] = None,
    prompt_lens: Optional[list[int]] = None,
    cfg=None,
    graphs=None,
) -> Optional[Draft]:
    """The run's Draft object. With a graph set that holds a device draft (its caches and state buffers
    are what the round's graphs replay over), that one."""
    if plan is None:
        return None
    if graphs is not None and graphs.draft is not None:
        return graphs.draft
    ctx = DraftContext(target, batch_size, k, cfg, references, prompt_lens)
    return DRAFTS[plan.algorithm].make(plan, head, ctx)
