"""The weightless drafts' plans and factories: n-gram (draft.ngram_min..ngram_max) and the oracle (the
baseline's outputs, which the run's DraftContext carries)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.drafts.base import Draft, DraftContext, DraftPlan, FeatureKind
from engine.drafts.config import DraftKeys
from engine.drafts.lookup.drafts import NgramDraft, OracleDraft
from engine.errors import ConfigError
from engine.model import ModelArgs


@dataclass
class NgramConfig(DraftKeys):
    """draft=ngram (prompt lookup; engine/drafts/config.py)."""

    algorithm: str = "ngram"
    ngram_max: int = 3  # longest suffix tried first
    ngram_min: int = 1  # shortest suffix that may match


@dataclass
class OracleConfig(DraftKeys):
    """draft=oracle: the common keys only."""

    algorithm: str = "oracle"


def plan_ngram(cfg, target: ModelArgs) -> DraftPlan:
    if not 1 <= cfg.ngram_min <= cfg.ngram_max:
        raise ConfigError(
            "draft.ngram_min",
            cfg.ngram_min,
            f"must be in [1, draft.ngram_max={cfg.ngram_max}]",
            "1 <= ngram_min <= ngram_max",
        )
    return DraftPlan("ngram", FeatureKind.none)


def plan_oracle(cfg, target: ModelArgs) -> DraftPlan:
    return DraftPlan("oracle", FeatureKind.none)


def make_ngram(plan: DraftPlan, head, ctx: DraftContext) -> Draft:
    return NgramDraft(ctx.cfg.ngram_max, ctx.cfg.ngram_min)


def make_oracle(plan: DraftPlan, head, ctx: DraftContext) -> Draft:
    if ctx.references is None:
        raise RuntimeError("the oracle draft needs the baseline's outputs (eval.baseline=true)")
    return OracleDraft(ctx.references, ctx.prompt_lens)
