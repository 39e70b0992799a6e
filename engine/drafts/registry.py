"""The draft registry: the table of algorithms, one per folder, and the three calls the stages make.

    DRAFTS[name]                  -> Algorithm    each folder's record (engine/drafts/base.py)
    SCHEMAS[name]                 -> dataclass    the `draft=<name>` option's Hydra schema (engine/drafts/config.py)
    algorithm(name)               -> Algorithm    the lookup: an unknown name is one ConfigError listing ALGORITHMS
    draft_config(name, **keys)    -> its schema   a draft config outside Hydra (tests, scripts)
    plan_draft(cfg, target_args)  -> DraftPlan    config.json + safetensors header only (the folder's plan)
    load_head(plan, target, ...)  -> head | None  weights (or random init), sharing target storage
    make_draft(plan, head, ...)   -> Draft | None per-eval draft object (its own KV cache)

Adding a draft is a folder exporting an `Algorithm` and one row here; nothing else names it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from engine.drafts import dflash, eagle, eagle3, lookup, multi_layer
from engine.drafts.base import Algorithm, Draft, DraftContext, DraftPlan
from engine.drafts.config import NoDraft
from engine.drafts.train_contract import TrainSpec
from engine.errors import ConfigError
from engine.model import LlamaModel, ModelArgs, init_normal_

DRAFTS: dict[str, Algorithm] = {
    a.name: a
    for a in (eagle3.ALGORITHM, eagle.ALGORITHM, multi_layer.ALGORITHM, lookup.NGRAM, lookup.ORACLE, dflash.ALGORITHM)
}
ALGORITHMS = ("none", *DRAFTS)  # every valid draft.algorithm
SCHEMAS: dict[str, type] = {"none": NoDraft, **{name: a.config for name, a in DRAFTS.items()}}
# The trainable ones, and how each trains (stage train_draft).
TRAIN_SPECS: dict[str, TrainSpec] = {name: a.train for name, a in DRAFTS.items() if a.train is not None}


def algorithm(name: str, key: str = "draft.algorithm") -> Algorithm:
    """The registered algorithm `name`; anything else is one error naming `key` and every valid name."""
    if name not in DRAFTS:
        raise ConfigError(key, name, "unknown draft algorithm", ALGORITHMS)
    return DRAFTS[name]


def train_spec(name: str, key: str = "draft.algorithm") -> TrainSpec:
    """How the algorithm `name` trains; one error listing the trainable ones when it does not."""
    spec = DRAFTS[name].train if name in DRAFTS else None
    if spec is None:
        raise ConfigError(key, name, "no trainer for this draft", sorted(TRAIN_SPECS))
    return spec


def draft_config(name: str, **keys: Any):
    """The `draft=<name>` schema with `keys` set (an unknown name or key: a ConfigError or TypeError)."""
    if name not in SCHEMAS:
        raise ConfigError("draft.algorithm", name, "unknown draft algorithm", ALGORITHMS)
    return SCHEMAS[name](**keys)


def plan_draft(cfg, target: ModelArgs) -> Optional[DraftPlan]:
    if cfg.algorithm == "none":
        return None
    spec = algorithm(cfg.algorithm)
    if not isinstance(cfg, spec.config):  # draft=X with draft.algorithm=Y: X's keys, not Y's
        raise ConfigError(
            "draft.algorithm",
            cfg.algorithm,
            f"the draft config's keys are {type(cfg).__name__}'s, not {cfg.algorithm}'s",
            f"draft={cfg.algorithm} (the option sets the algorithm and its keys)",
        )
    if cfg.num_steps < 1:
        raise ConfigError("draft.num_steps", cfg.num_steps, "a draft proposes at least one token", ">= 1")
    if (factor := getattr(cfg, "temperature_factor", None)) is not None and not factor > 0:
        raise ConfigError(
            "draft.temperature_factor", factor, "the head's q is drawn at temperature T x this", "> 0, or null"
        )
    try:
        plan = dataclasses.replace(spec.plan(cfg, target), spec=spec)
        head = None
        if plan.checkpoint is not None and plan.head_config is not None:  # every tensor, before any is read
            with torch.device("meta"):
                head = spec.head(plan.head_config, 2)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # a config.json with odd values
        if isinstance(e, ConfigError) or getattr(cfg, "init", None) != "checkpoint":
            raise
        raise ConfigError(
            "draft.path",
            cfg.path,
            f"its config.json does not describe a {cfg.algorithm} head ({type(e).__name__}: {e})",
        ) from None
    if head is not None:
        if problems := plan.checkpoint.tensor_problems(head):
            raise ConfigError(
                "draft.path", cfg.path, f"its tensors do not match its config.json: {'; '.join(problems[:6])}"
            )
    return dataclasses.replace(plan, temperature_factor=temperature_factor(cfg, plan))


def temperature_factor(cfg, plan: DraftPlan) -> float:
    """What sampled rounds multiply the request's temperature by for the head's q: draft.temperature_factor,
    else the head's config.json `draft_temperature_factor` (measured for the shipped heads), else 1."""
    if (key := getattr(cfg, "temperature_factor", None)) is not None:  # checked > 0 in plan_draft
        return float(key)
    own = (plan.head_config or {}).get("draft_temperature_factor", 1.0) if plan.checkpoint is not None else 1.0
    if isinstance(own, bool) or not isinstance(own, (int, float)) or not own > 0:
        raise ConfigError(
            "draft.path",
            cfg.path,
            f"its config.json's draft_temperature_factor {own!r} is not a positive number",
            "a number > 0 there, or draft.temperature_factor=<x> to override it",
        )
    return float(own)


def load_head(plan: Optional[DraftPlan], target: LlamaModel, seed: int, device, dtype) -> Optional[torch.nn.Module]:
    """The draft's head on device, sharing the target's embedding (and lm_head where it has none of its own)."""
    if plan is None or plan.head_config is None:
        return None
    head = plan.spec.head(plan.head_config, target.max_seq_len)
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
    draft = plan.spec.make(plan, head, ctx)
    if draft.on_device:
        draft.temperature_factor = plan.temperature_factor  # read by its q_draws
    return draft
