"""`GraphSet`: every runner of a run, bound to the buffers and caches they replay over, captured in one pool.

Phases (bucket = (rows, tokens per row)):

    round_k{k}          the whole speculative round with k draft tokens (engine/speculative/round.py) over the
                        state buffers, [B, k+1] per capture size B: draft chain, verify + accept, draft
                        extend, one graph each; k = 0 is the plain decode step (the no-draft baseline)
    round_k{k}_sampled  the same where rows sample (each by its own temperature, top-p and seed in the
                        state buffers: sampled drafts, rejection sampling on the device, no break),
                        captured when the run samples (eval temperature > 0, a server)
    prefill             the target's prefill, [R, T] per prompt-length bucket T, under every CUDA
                        policy: one graph with the Triton attention, else captured segments between
                        SDPA attention breaks (piecewise); debug under debug; FULL for drafts that
                        read features. R = max_batch over the round cache (a batch prefills rows
                        0..b-1), or over a staging cache of `prefill_rows` rows (a server: requests
                        join at any free slots; their KV is copied there): R = 1 at every T, and
                        R = prefill_rows where R x T fits the largest bucket (prompts joining together)
    draft_prefill       a device draft's prefill (`DeviceDraft.prefill_program`) over the same buckets
                        and rows, into its cache or a staging one, under the draft's policy; its state
                        rows come out for the caller to write; `_sampled` draws d_1 (sampled runs)

Policies are per side: the target's steps follow `target_policy`, a device draft's `draft_policy`
(engine/speculative/round.py: which steps are breaks). Graphs are captured largest bucket first, all phases sharing
one CUDA memory pool. The caches and state buffers are allocated once, because a graph holds their
addresses: generators take them from the set (`cache`, `buffers`, and `draft`, the device draft whose
own cache and buffers the round reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.drafts.base import Draft
from engine.graphs.backends import NEEDS_CUDA
from engine.graphs.runner import TARGET_OUT, CaptureHiddenMode, GraphRunner, InputSpec, PhaseStats, token_inputs
from engine.model import LlamaModel
from engine.speculative.round import round_buffers, round_program, round_specs

M = CaptureHiddenMode
ROUND_OUT = {m: ("out",) for m in M}


def round_name(k: int, sampled: bool = False) -> str:
    return f"round_k{k}" + ("_sampled" if sampled else "")


def draft_prefill_name(sampled: bool = False) -> str:
    return "draft_prefill" + ("_sampled" if sampled else "")


def round_policy(target_policy: str, draft_policy: Optional[str]) -> Optional[str]:
    """The backend of the round runner: None (every side eager: no runner), debug, or breakable (a
    phased graph that runs exactly the steps each side marked as breaks eagerly)."""
    sides = (target_policy,) if draft_policy is None else (target_policy, draft_policy)
    if all(p == "none" for p in sides):
        return None
    return "debug" if "debug" in sides else "breakable"


@dataclass
class GraphSet:
    target: LlamaModel
    draft: Optional[Draft]  # a device draft (its cache and buffers are the round's), or None
    batch_size: int
    num_steps: int  # the most draft tokens a round takes: the buffers' width
    target_policy: str
    draft_policy: str
    sizes: list[int]
    prefill_buckets: list[int]
    features: bool  # the draft reads target hidden states: verify/prefill capture FULL
    sampled: bool = False  # also capture the rounds with rejection sampling
    round_ks: Optional[list[int]] = None  # the k of each captured round (None: num_steps alone)
    prefill_rows: Optional[int] = None  # prefill graphs over a staging cache of this many rows (None: the round cache)
    runners: dict[str, GraphRunner] = field(default_factory=dict)

    @property
    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(rows, tokens) of the prefill graphs: the batch at every bucket, or over a staging cache one
        prompt at every bucket and `prefill_rows` prompts where they fit the largest bucket's tokens."""
        if self.prefill_rows is None:
            return [(self.batch_size, n) for n in self.prefill_buckets]
        top, r = max(self.prefill_buckets), self.prefill_rows
        return [(1, n) for n in self.prefill_buckets] + [(r, n) for n in self.prefill_buckets if r > 1 and r * n <= top]

    def __post_init__(self):
        t, device = self.target, self.target.lm_head.weight.device
        self.cache = t.new_cache(self.batch_size)
        device_draft = self.draft if self.draft is not None and self.draft.on_device else None
        self.draft = device_draft
        k, sizes, h = self.num_steps, self.sizes, t.args.hidden_size
        self.buffers = round_buffers(k, device_draft, self.batch_size, device)
        draft_policy = self.draft_policy if device_draft is not None else None
        policy = round_policy(self.target_policy, draft_policy)
        cuda = {self.target_policy, draft_policy} & NEEDS_CUDA
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        full = M.FULL if self.features else M.NULL

        def meta() -> dict:
            return {"aux_layer_ids": t.aux_layer_ids, **(device_draft.graph_meta() if device_draft else {})}

        self.round_ks = sorted(set(self.round_ks if self.round_ks is not None else [k]))
        if max(self.round_ks) > k:
            raise ValueError(f"round_ks {self.round_ks} exceed the buffers' {k} draft tokens")
        if policy is not None:
            specs = round_specs(k, device_draft)
            for rk in self.round_ks:
                for sampled in (False, True)[: 1 + self.sampled]:

                    def build(b, rk=rk, sampled=sampled):
                        return round_program(
                            t,
                            self.cache,
                            device_draft,
                            rk,
                            b,
                            sampled=sampled,
                            target_policy=self.target_policy,
                            draft_policy=self.draft_policy,
                        )

                    name = round_name(rk, sampled)
                    self.runners[name] = GraphRunner(
                        name,
                        policy,
                        build,
                        specs,
                        ROUND_OUT,
                        full,
                        [(b, rk + 1) for b in sizes],
                        device,
                        t.max_seq_len,
                        meta,
                        self.pool,
                        buffers=self.buffers,
                    )
        self.prefill_cache = None  # the cache the prefill graphs write: the round cache, or a staging one
        if self.target_policy != "none" and self.prefill_buckets:
            rows = self.prefill_rows or self.batch_size
            self.prefill_cache = self.cache if self.prefill_rows is None else t.new_cache(rows)
            # the Triton attention reads each row's live length on the device: one graph per bucket;
            # SDPA must see the live kv_len: captured segments between eager attention breaks
            backend = (
                ("full" if t.attention_kernel else "piecewise")
                if self.target_policy in NEEDS_CUDA
                else self.target_policy
            )
            inputs = {
                **token_inputs(),
                "input_embeds": InputSpec((h,), t.lm_head.weight.dtype, 0),
                "logits_index": InputSpec((), torch.long, 0, per_row=True),
            }
            self.runners["prefill"] = GraphRunner(
                "prefill",
                backend,
                lambda b: t.program(self.prefill_cache.rows(b), embeds_input=True, logits_at_index=True, causal=True),
                inputs,
                TARGET_OUT,
                full,
                self.prefill_shapes,
                device,
                t.max_seq_len,
                lambda: {"aux_layer_ids": t.aux_layer_ids},
                self.pool,
            )
        self.draft_prefill_cache = None  # the draft cache its prefill graphs write (the draft's, or a staging one)
        if draft_policy not in (None, "none") and self.prefill_buckets:
            d, rows = device_draft, self.prefill_rows or self.batch_size
            self.draft_prefill_cache = d.cache if self.prefill_rows is None else d.head.new_cache(rows)
            backend = ("full" if d.attention_kernel else "piecewise") if draft_policy in NEEDS_CUDA else draft_policy
            for sampled in (False, True)[: 1 + (self.sampled and d.draws_at_prefill)]:
                outs = (*d.own_specs(k), *(("d_q",) if sampled else ()))
                self.runners[draft_prefill_name(sampled)] = GraphRunner(
                    draft_prefill_name(sampled),
                    backend,
                    lambda b, sampled=sampled: d.prefill_program(self.draft_prefill_cache.rows(b), sampled),
                    {**token_inputs(), **d.prefill_specs()},
                    {m: outs for m in M},
                    M.NULL,
                    self.prefill_shapes,
                    device,
                    t.max_seq_len,
                    d.graph_meta,
                    self.pool,
                    buffers=self.runners[draft_prefill_name(False)].buffers if sampled else None,  # one feats
                )

    def capture(self) -> "GraphSet":
        """Largest buckets first within each runner."""
        for r in self.runners.values():
            r.capture()
        return self

    def get(self, name: str) -> Optional[GraphRunner]:
        return self.runners.get(name)

    def stats(self) -> dict[str, PhaseStats]:
        return {name: r.stats for name, r in self.runners.items()}

    def metrics(self) -> dict[str, float]:
        """capture_s, graph_mem_mb, graph_replays, graph_fallbacks: totals and per phase."""
        out: dict[str, float] = {}
        for key in ("capture_s", "graph_mem_mb", "replays", "fallbacks"):
            name = key if key.startswith(("capture", "graph")) else f"graph_{key}"
            vals = {p: getattr(s, key) for p, s in self.stats().items()}
            out[name] = sum(vals.values())
            out.update({f"{name}.{p}": v for p, v in vals.items()})
        return out
