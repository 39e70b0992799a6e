"""The speculative round in one place: propose k -> verify k + 1 -> accept -> extend, over a typed state.

The state lives on the device in buffers allocated once (a graph replays over their addresses); a round
reads and advances it in place and costs one device->host copy: `out`, read by the host to emit tokens.

    RoundState, b rows, K the most draft tokens any round of the run takes:
    last [b] int64         each row's last emitted token (not yet in the target cache)
    lengths [b] int64      tokens in the target cache (= the position of `last`)
    live [b] bool          rows still generating; others ride along writing only the dummy slot
    draft [b, K] int64     the round's draft tokens (the first k): a device draft writes them, the host
                           copies a host draft's (n-gram, oracle) in
    out [b, K + 2] int64   [a, the emitted tokens]: d_1..d_a then the bonus at index a
    temperature, top_p [b] fp32, seed [b] int64, speculate [b] bool: each row's sampling (0: greedy)
    q [b, K, Vd] fp32      a sampled round's proposal distributions; own: the draft's own state buffers

    propose  the device draft's k proposals -> draft                                  (phase draft)
    verify   the target on [last, draft] at lengths + 0..k -> accept on the device -> out (phase verify)
    extend   the draft catches up on the verified positions; lengths += a + 1, last = bonus (phase extend)

Each phase is its own graph (engine/graphs/breakable.py `phase`). A side (target, draft) under policy
none runs eagerly as a whole; under breakable / debug with SDPA its attentions run eagerly (the live
kv_len); otherwise (full, or the Triton attention) it is captured whole. k = 0 is plain decoding: no
draft phase, no draft extend, no aux capture, whatever the run's draft.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from engine.drafts.base import Draft, FeatureKind, RoundState, Verified
from engine.graphs.breakable import captured, eager, phase
from engine.graphs.program import Step
from engine.graphs.runner import InputSpec, allocate
from engine.model import LlamaModel, StaticKVCache
from engine.ops import Live
from kernels.accept import accept_greedy as accept_kernel
from kernels.accept import accept_greedy_reference, advance, advance_reference, write_out_reference
from kernels.sample import accept, accept_reference

PHASES = ("draft", "verify", "extend")  # in this order in every round
FEATURES = {FeatureKind.aux: "aux_hidden_states", FeatureKind.final: "hidden_states"}  # what the extend reads


def round_specs(k: int, draft: Optional[Draft]) -> dict[str, InputSpec]:
    """The round's state buffers (per row, kept across calls), the draft's own included."""
    row = lambda tail, dtype, pad: InputSpec(tail, dtype, pad, per_row=True, state=True)  # noqa: E731
    specs = {
        "last": row((), torch.long, 0),
        "lengths": row((), torch.long, 0),
        "live": row((), torch.bool, False),
        "draft": row((k,), torch.long, 0),
        "out": row((k + 2,), torch.long, None),
        "temperature": row((), torch.float32, None),
        "top_p": row((), torch.float32, None),
        "seed": row((), torch.long, None),
        "speculate": row((), torch.bool, None),
    }
    if draft is not None:
        specs.update(draft.state_specs(k))
    return specs


def round_buffers(k: int, draft: Optional[Draft], rows: int, device) -> dict[str, Tensor]:
    """The state buffers a round runs over: its own, allocated here for `rows` rows, and a device draft's."""
    own = allocate(round_specs(k, None), rows, device)
    own["speculate"].fill_(True)  # rows that never started (begin alone, a warm-up) take drafts as before
    return {**own, **(draft.buf if draft is not None and draft.on_device else {})}


def side(fn, policy: str, attention_kernel: bool):
    """fn as its side's graph policy runs it: eagerly as a whole (none), split at its eager marks
    (breakable / debug with SDPA: the live kv_len), or captured whole (full, the Triton attention)."""
    if policy == "none":
        return eager(fn)
    if policy in ("breakable", "piecewise", "debug") and not attention_kernel:
        return fn

    def whole(*args):
        with captured():
            return fn(*args)

    return whole


class Round:
    """One round over the first `rows` rows of the target's cache and of a device draft's (None: no
    draft, or a host draft whose tokens the caller copies into `draft`)."""

    def __init__(self, target: LlamaModel, cache, draft, k: int, rows: int, sampled: bool, policies: tuple[str, str]):
        self.target, self.k, self.sampled = target, k, sampled
        self.cache = cache.rows(rows)
        self.draft = draft if draft is not None and draft.on_device and k > 0 else None
        self.draft_cache = self.draft.cache.rows(rows) if self.draft is not None else None
        self.kernels = target.fused  # the Triton kernels run (CUDA, or the interpreter in tests)
        self.forward = side(self.verify_forward, policies[0], target.attention_kernel)
        if self.draft is not None:
            self.propose = side(self.draft.propose_into, policies[1], self.draft.attention_kernel)
            self.extend = side(self.draft.extend, policies[1], self.draft.attention_kernel)

    def __call__(self, s: RoundState, kv_len: Live) -> None:
        k = self.k
        if self.draft is not None:
            phase("draft")
            self.propose(s, self.draft_cache, k, kv_len, self.sampled)  # -> s.draft[:, :k]
        phase("verify")
        v = self.verify(s, kv_len)
        phase("extend")
        if self.draft is not None:
            self.extend(s, self.draft_cache, v, kv_len, self.sampled)
        (advance if self.kernels else advance_reference)(s.lengths, s.last, s.live, v.accepted, v.bonus)

    def verify(self, s: RoundState, kv_len: Live) -> Verified:
        k, b = self.k, s.live.shape[0]
        tokens = torch.cat([s.last[:, None], s.draft[:, :k]], 1)  # [b, k+1]: x_L, d_1..d_k
        positions = s.lengths[:, None] + torch.arange(k + 1, device=s.lengths.device)  # [b, k+1]: L..L+k
        valid = s.live[:, None].expand(b, k + 1)  # finished rows write the dummy slot
        logits, ids, feats = self.forward(tokens, positions, valid, kv_len + (k + 1))
        drafted, out = s.draft[:, :k], s.out  # [b, k], [b, K+2]
        if not self.sampled:  # keep d_i while it is the target's argmax; the bonus: the argmax after
            if self.kernels:
                accepted, bonus = accept_kernel(ids, drafted, out, s.speculate)
            else:
                accepted, bonus = accept_greedy_reference(ids, drafted, s.speculate)  # [b], [b]
                write_out_reference(drafted, accepted, bonus, out)
        else:  # each row by its own rule: rejection sampling against q (one-hot for host drafts)
            d = self.draft
            accepted, bonus = (accept if self.kernels else accept_reference)(
                logits,
                drafted,
                s.q[:, :k] if d is not None else None,
                d.vocab_map if d is not None else None,
                s.temperature,
                s.top_p,
                s.seed,
                s.lengths,
                s.speculate,
                out,
            )
        return Verified(out[:, 1 : k + 2], out[:, 0], bonus, feats)

    def verify_forward(self, tokens: Tensor, positions: Tensor, valid: Tensor, kv_len: Live) -> tuple:
        """The target on the k + 1 positions -> (logits, ids, the draft's features) (its side's policy).
        A round without a draft (k = 0) captures no aux hidden states: nothing reads them."""
        t = self.target
        saved, t.aux_layer_ids = t.aux_layer_ids, t.aux_layer_ids if self.draft is not None else ()
        try:
            out = t(tokens, positions, self.cache, valid=valid, kv_len=kv_len, greedy=not self.sampled)
        finally:
            t.aux_layer_ids = saved
        kind = self.draft.features if self.draft is not None else FeatureKind.none
        return out.logits, out.ids, getattr(out, FEATURES[kind]) if kind in FEATURES else None


def round_program(
    target: LlamaModel,
    cache: StaticKVCache,
    draft: Optional[Draft],
    k: int,
    rows: int,
    *,
    sampled: bool = False,
    target_policy: str = "none",
    draft_policy: str = "none",
) -> list[Step]:
    """The round as a program (one step over the state buffers by name) for the graph runners."""
    r = Round(target, cache, draft, k, rows, sampled, (target_policy, draft_policy))

    def run(env: dict) -> None:
        r(RoundState.of(env), Live.of(env["kv_len"]))

    meta = {"aux_layer_ids": target.aux_layer_ids, **(r.draft.graph_meta() if r.draft is not None else {})}
    return [Step("round", run, meta=meta)]
