"""The speculative round as one device program: propose k -> verify k + 1 -> accept -> extend -> advance.

The round's state lives on the device, in buffers allocated once (a graph replays over their addresses),
and the program reads and advances it in place, so a round needs no host input (device drafts) and
costs one device->host copy: `out`, read by the host to emit tokens.

    last     [B]        int64  each row's last emitted token (not yet in the target cache)
    lengths  [B]        int64  tokens in the target cache (= the position of `last`)
    live     [B]        bool   rows still generating; others ride along writing only the dummy slot
    draft    [B, K]     int64  the round's draft tokens (the first k): the chain writes them (device
                               drafts), or the host copies them in (n-gram, oracle)
    out      [B, K + 2] int64  [a, the emitted tokens]: d_1..d_a then the bonus at index a (first k + 2)
    temperature, top_p [B] fp32, seed [B] int64, speculate [B] bool
                               each row's sampling (temperature 0: greedy) and whether it takes draft tokens,
                               written by the host when a row starts (engine/sampling.py RowSettings)

    + the draft's own state (`draft.state_specs`: EAGLE's carried hidden state and next token, the
      multi-layer draft's per-module pool, q [B, K, Vd]: the sampled proposals' distributions, ...)

K is the most draft tokens any round of the run takes; a round of k <= K (k = 0: the plain decode
step of the no-draft baseline; serve's k that follows the load) uses the first columns.

Phases (engine/program.py: each is its own graph replay, so a clock can time them):

    draft    the k-step chain (device drafts): draft.propose_steps -> draft (sampled rounds: sampled rows
             draw each proposal from the draft's q and keep q)
    verify   tokens [b, k+1] = [last, draft] at positions lengths + 0..k, valid = live -> the target's
             forward (scoped under "t."); accept on the device -> out: greedy (the argmax epilogue's ids,
             kernels/accept.py) or, in the sampled variant, each row by its own rule (kernels/sample.py:
             rejection sampling against q, greedy rows exactly greedy, counter-based random numbers)
    extend   draft.commit_steps over the k + 1 verified positions (features, emitted, accepted), then
             lengths += a + 1 and last = bonus for live rows

Breaks: a side's attention is a break only when it must see the live kv_len (SDPA under breakable /
piecewise); a side with graph policy none runs every step eagerly between the other side's graphs.
With the Triton attention kernel (each row's live length read on the device) neither the greedy nor
the sampled round has a break at all: three graphs, one per phase.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from engine.drafts.base import Draft
from engine.graphs.breakable import captured
from engine.graphs.runner import InputSpec, allocate
from engine.model import LlamaModel, StaticKVCache
from engine.program import Step, merge_runs, scoped, with_phase
from kernels.accept import accept_greedy as accept_kernel
from kernels.accept import accept_greedy_reference, advance, advance_reference, write_out_reference
from kernels.sample import accept, accept_reference

PHASES = ("draft", "verify", "extend")  # in this order in every round


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


def side_breaks(steps: list[Step], policy: str, attention_kernel: bool) -> list[Step]:
    """One side's steps with the breaks its graph policy needs (see the module docstring): every step
    eager (policy none), its breaks and eager marks kept, or everything captured."""
    if policy == "none":
        return [replace(s, is_break=True) for s in steps]
    if policy in ("breakable", "piecewise", "debug") and not attention_kernel:
        return steps
    return [replace(s, is_break=s.host, fn=s.fn if s.host else _captured(s.fn)) for s in steps]


def _captured(fn):
    def run(env: dict) -> None:
        with captured():  # its eager marks (the attention) are captured too
            fn(env)

    return run


def _accept_greedy(k: int, kernels: bool, draft: Optional[Draft]):
    """-> out [b, k+2] = [a, the emitted tokens], accepted, bonus, emitted (views of out where they can
    be), from the target's argmax ids. kernels: one launch (kernels/accept.py), else plain torch."""

    def fn(env: dict) -> None:
        drafted, out = env["draft"][:, :k], env["out"]  # [b, k], [b, K+2]
        if kernels:
            accepted, bonus = accept_kernel(env["t.ids"], drafted, out, env["speculate"])
        else:
            accepted, bonus = accept_greedy_reference(env["t.ids"], drafted, env["speculate"])  # [b], [b]
            write_out_reference(drafted, accepted, bonus, out)
        env["accepted"], env["bonus"], env["emitted"] = out[:, 0], bonus, out[:, 1 : k + 2]

    return fn


def _accept_sampled(k: int, kernels: bool, draft: Optional[Draft]):
    """The same from the target's logits [b, k+1, V], each row by its own rule (kernels/sample.py: four
    launches, else plain torch): against the device draft's q, or a one-hot q (host drafts, k = 0)."""
    rule = accept if kernels else accept_reference

    def fn(env: dict) -> None:
        drafted, out = env["draft"][:, :k], env["out"]
        q = env["d_q"][:, :k] if draft is not None else None  # [b, k, Vd]
        accepted, bonus = rule(
            env["t.logits"],
            drafted,
            q,
            draft.vocab_map if draft is not None else None,
            env["temperature"],
            env["top_p"],
            env["seed"],
            env["lengths"],
            env["speculate"],
            out,
        )
        env["accepted"], env["bonus"], env["emitted"] = out[:, 0], bonus, out[:, 1 : k + 2]

    return fn


ACCEPT = {False: _accept_greedy, True: _accept_sampled}  # sampled -> the accept step's builder


def _verify_inputs(k: int):
    def fn(env: dict) -> None:
        live, lengths = env["live"], env["lengths"]  # [b], [b]
        b = live.shape[0]
        env["t.tokens"] = torch.cat([env["last"][:, None], env["draft"][:, :k]], 1)  # [b, k+1]
        env["t.positions"] = lengths[:, None] + torch.arange(k + 1, device=lengths.device)  # [b, k+1]
        env["t.valid"] = live[:, None].expand(b, k + 1)

    return fn


def _advance(kernels: bool):
    def fn(env: dict) -> None:
        (advance if kernels else advance_reference)(
            env["lengths"], env["last"], env["live"], env["accepted"], env["bonus"]
        )

    return fn


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
    """The round over the first `rows` rows of the target's cache and of the draft's: a list of steps
    in phases draft, verify, extend. `draft` is a device draft (its steps run here) or None (no draft,
    or a host draft whose tokens the caller copies into `draft`)."""
    steps: list[Step] = []
    device_draft = draft is not None and draft.on_device and k > 0
    cache = cache.rows(rows)
    draft_cache = draft.cache.rows(rows) if device_draft else None
    if device_draft:
        chain = side_breaks(draft.propose_steps(draft_cache, k, sampled=sampled), draft_policy, draft.attention_kernel)
        steps += with_phase(chain, "draft")
    verify_steps = side_breaks(target.program(cache, greedy=not sampled), target_policy, target.attention_kernel)
    kernels = target.fused  # the Triton kernels run (CUDA, or the interpreter in tests)
    accept_step = ACCEPT[sampled](k, kernels, draft if device_draft else None)
    steps += with_phase(
        [Step("verify_in", _verify_inputs(k))]
        + scoped("t.", merge_runs(verify_steps), k + 1)
        + [Step("accept", accept_step)],
        "verify",
    )
    tail: list[Step] = []
    if device_draft:
        tail += side_breaks(draft.commit_steps(draft_cache, k, sampled=sampled), draft_policy, draft.attention_kernel)
    steps += with_phase(tail + [Step("advance", _advance(kernels))], "extend")
    steps = merge_runs(steps)
    meta: dict = {}
    for s in steps:
        meta.update(s.meta)
    steps[0].meta = meta  # what the runner checks against the models at every call
    return steps
