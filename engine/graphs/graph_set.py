"""`GraphSet`: every runner of a run, bound to the caches they replay over, captured in one pool.

Phases (bucket = (rows, tokens per row)):

    decode        target, [B, 1] per capture size B           mode NULL (the no-draft baseline)
    verify        target, [B, k+1] per capture size B          mode FULL when the draft reads features
    prefill       target, [max_batch, T] per prefill bucket T  piecewise only; FULL for EAGLE drafts
    draft phases  declared by the draft head (`head.graph_phases(k)` -> [DraftPhase]), e.g. EAGLE's
                  draft_step [B, 1] mode LAST and draft_extend [B, k+1] mode FULL

Graphs are captured largest bucket first, all phases sharing one CUDA memory pool. The caches are
allocated here, once, because a graph holds their addresses: generators and drafts take them from
the set (`cache`, `draft_cache` = `head.new_cache(batch_size)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from engine.graphs.backends import NEEDS_CUDA
from engine.graphs.runner import CaptureHiddenMode, GraphRunner, InputSpec, PhaseStats
from engine.model import LlamaModel, Step

M = CaptureHiddenMode
TARGET_OUT = {M.NULL: ("logits",), M.LAST: ("logits", "hidden"), M.FULL: ("logits", "hidden", "aux", "embeds")}


def _token_inputs() -> dict[str, InputSpec]:
    return {"tokens": InputSpec((), torch.long, 0), "positions": InputSpec((), torch.long, 0),
            "valid": InputSpec((), torch.bool, False)}


@dataclass(frozen=True)
class DraftPhase:
    """One draft graph phase, as a head declares it (`head.graph_phases(num_steps)`).

    Buckets are [(B, tokens) for B in the capture sizes]; every phase has the static inputs tokens,
    positions and valid ([B, tokens]) plus `inputs`; `build(cache_rows)` is the program over a row
    view of the draft cache; `outputs[mode]` names the env keys a replay returns. `shares`: an earlier
    phase whose static input buffers this one replays over too (one buffer set for several runners;
    every call copies its live inputs in before replaying, so runners that run in turn may share).
    """

    name: str
    tokens: int  # tokens per row
    mode: CaptureHiddenMode
    inputs: dict[str, InputSpec]
    outputs: dict[CaptureHiddenMode, tuple[str, ...]]
    build: Callable[[Any], list[Step]]
    shares: Optional[str] = None


@dataclass
class GraphSet:
    target: LlamaModel
    head: Optional[torch.nn.Module]
    batch_size: int
    num_steps: int
    target_policy: str
    draft_policy: str
    sizes: list[int]
    prefill_buckets: list[int]
    features: bool  # the draft reads target hidden states: verify/prefill capture FULL
    runners: dict[str, GraphRunner] = field(default_factory=dict)

    def __post_init__(self):
        t, device = self.target, self.target.lm_head.weight.device
        self.cache = t.new_cache(self.batch_size)
        self.draft_cache = self.head.new_cache(self.batch_size) if self.head is not None else None
        cuda = {self.target_policy, self.draft_policy} & NEEDS_CUDA
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        k, sizes, h = self.num_steps, self.sizes, t.args.hidden_size
        dtype = t.lm_head.weight.dtype
        full = M.FULL if self.features else M.NULL
        target_meta = lambda: {"aux_layer_ids": t.aux_layer_ids}  # noqa: E731

        def target_runner(name, buckets, mode, embeds=False, at_index=False):
            inputs = _token_inputs()
            if embeds:
                inputs["input_embeds"] = InputSpec((h,), dtype, 0)
            if at_index:
                inputs["logits_index"] = InputSpec((), torch.long, 0, per_row=True)
            build = lambda b: t.program(self.cache.rows(b), embeds_input=embeds, logits_at_index=at_index)  # noqa: E731
            return GraphRunner(name, self.target_policy, build, inputs, TARGET_OUT, mode, buckets,
                               device, t.max_seq_len, target_meta, self.pool)

        if self.target_policy != "none":
            self.runners["decode"] = target_runner("decode", [(b, 1) for b in sizes], M.NULL)
            if k > 0:
                self.runners["verify"] = target_runner("verify", [(b, k + 1) for b in sizes], full)
            if self.target_policy == "piecewise":
                self.runners["prefill"] = target_runner(
                    "prefill", [(self.batch_size, n) for n in self.prefill_buckets], full, embeds=True,
                    at_index=True)
        if self.head is not None and self.draft_policy != "none" and k > 0:
            head = self.head
            for ph in head.graph_phases(k):
                build = lambda b, ph=ph: ph.build(self.draft_cache.rows(b))  # noqa: E731
                shared = self.runners[ph.shares].buffers if ph.shares else None
                self.runners[ph.name] = GraphRunner(
                    ph.name, self.draft_policy, build, {**_token_inputs(), **ph.inputs}, ph.outputs, ph.mode,
                    [(b, ph.tokens) for b in sizes], device, t.max_seq_len, head.graph_meta, self.pool,
                    buffers=shared)

    def capture(self) -> "GraphSet":
        """Largest buckets first within each runner; target phases before draft phases."""
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
