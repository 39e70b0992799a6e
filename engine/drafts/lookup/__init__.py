"""Weightless drafts that read the token history on the host: `ngram` (prompt lookup) and `oracle` (the
no-draft baseline's own outputs: the ceiling of the loop). No head, no training.

    drafts.py  NgramDraft, OracleDraft
    plan.py    their plans (draft.ngram_min/ngram_max) and factories
"""

from engine.drafts.base import Algorithm
from engine.drafts.lookup.drafts import NgramDraft, OracleDraft, ngram_lookup
from engine.drafts.lookup.plan import make_ngram, make_oracle, plan_ngram, plan_oracle

NGRAM = Algorithm(name="ngram", plan=plan_ngram, make=make_ngram)
ORACLE = Algorithm(name="oracle", plan=plan_oracle, make=make_oracle, needs_baseline=True)

__all__ = ["NGRAM", "ORACLE", "NgramDraft", "OracleDraft", "ngram_lookup"]
