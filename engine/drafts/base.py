"""The draft interface every algorithm implements, and the state the speculative loop shares with it.

Round structure (chain drafting, k = num_steps), per sequence with `L` tokens in the target cache and
its last emitted token `x_L` not yet in it:

    propose             -> draft tokens d_1..d_k               [batch, k]
    target verify       on [x_L, d_1..d_k] at positions L..L+k   -> features [batch, k+1, F]
    accept a of them; emit d_1..d_a and the bonus token
    commit              the draft catches up on the a+1 verified positions (its "draft extend")

Two kinds of draft:

    host drafts    (n-gram, oracle) read the token history on the host: `propose(state, k)` returns the
                   tokens, which the round copies in
    device drafts  (`DeviceDraft`: EAGLE3, EAGLE, multi-layer EAGLE, DFlash) are programs inside the
                   round (engine/round.py): `propose_steps` (the k-step chain) and `commit_steps` (the
                   extend) over the round's env, their state in buffers of `batch_size` rows
                   (`state_specs`, `buf`) that a captured round replays over. Proposals are greedy
                   (argmax): the chain needs no random numbers, and rejection sampling against a
                   one-hot q stays lossless. `propose` / `commit` run the same steps eagerly, alone.

`begin` is the draft's prefill after the target's. With `rows=slice(i, j)` it prefills rows i..j-1 of a
batch of `batch_size` rows and leaves every other row's draft state (KV cache, carried hidden
states, pending proposal) as it was: requests join a running batch between rounds this way
(continuous batching). `rows=None` starts a fresh batch made of exactly these prompts. Drafts that read
target features declare which (`FeatureKind`): `aux` (EAGLE3: concatenated aux layers) or `final`
(EAGLE: the final normed hidden state); `none` for weightless drafts (n-gram, oracle).

The round env a device draft's steps read (engine/round.py): lengths [b], live [b], last [b] (x_L),
kv_len (host: the longest live length), the draft's own buffers' rows; propose writes draft [b, k];
commit reads emitted [b, k+1], accepted [b] and the verify's features (t.aux or t.hidden).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from engine.graphs.runner import allocate
from engine.program import run_steps


class FeatureKind(str, enum.Enum):
    none = "none"
    final = "final"  # target's final normed hidden states [b, t, hidden]
    aux = "aux"  # target's aux hidden states, concatenated [b, t, hidden * n_aux]


# Where a round's env holds the verify's features of each kind (the target's program under "t.").
FEATURE_KEYS = {FeatureKind.aux: "t.aux", FeatureKind.final: "t.hidden"}


@dataclass
class SpecState:
    """Host-side view of the batch, kept by the speculative loop."""

    history: list[list[int]]  # per row: prompt + emitted tokens (the last one not yet in the cache)
    lengths: list[int]  # per row: tokens in the target cache (= position of the last emitted token)
    live: list[bool]  # rows still generating
    row_ids: list[int]  # index of each row's prompt in the whole prompt set (for the oracle)
    device: object = None
    _staged: Optional[tuple] = field(default=None, repr=False)  # (host key, pinned [2, b], device [2, b])

    def on_device(self) -> tuple[Tensor, Tensor]:
        """(lengths [b] int64, live [b] bool) on the device, as of now.

        One non-blocking copy from a pinned buffer when the host lists changed (once per round), shared
        by the draft and the verify of the round. Reusing the buffer is safe: every round ends with a
        device->host sync, so the previous copy has completed before the buffer is written again.
        """
        key = (tuple(self.lengths), tuple(self.live))
        if self._staged is None or self._staged[0] != key:
            pinned = (
                self._staged[1]
                if self._staged is not None
                else torch.empty(
                    2, len(self.lengths), dtype=torch.long, pin_memory=getattr(self.device, "type", "cpu") == "cuda"
                )
            )
            pinned[0] = torch.tensor(self.lengths)
            pinned[1] = torch.tensor(self.live)
            self._staged = (key, pinned, pinned.to(self.device, non_blocking=True))
        both = self._staged[2]
        return both[0], both[1].bool()


@dataclass
class Proposal:
    tokens: Tensor  # [b, k] int64, target vocabulary
    probs: Optional[Tensor] = None  # [b, k, vocab] draft distribution; None: deterministic (one-hot)


class Draft:
    """Base class: host drafts override `propose` only."""

    features: FeatureKind = FeatureKind.none
    on_device = False  # its propose / commit are steps of the round program

    def begin(
        self,
        state: SpecState,
        feats: Optional[Tensor],
        prompt_tokens: Tensor,
        valid: Tensor,
        input_embeds: Optional[Tensor],
        first: Tensor,
        rows: Optional[slice] = None,
    ) -> None:
        """Draft prefill. prompt_tokens/valid [n, T]; feats [n, T, F]; input_embeds [n, T, H] (the
        target's, reused for prompt positions); first [n]: the target's first emitted token.
        rows: the batch rows these n prompts occupy (None: they are the whole batch)."""

    def propose(self, state: SpecState, k: int) -> Proposal:
        raise NotImplementedError


class DeviceDraft(Draft):
    """A draft whose round work is device programs over state buffers of `batch_size` rows.

    Subclasses set `head` and define `state_specs`, `propose_steps`, `commit_steps` and `begin`.
    """

    on_device = True
    head: torch.nn.Module
    batch_size: int

    def __init__(self, head, batch_size: int, k: int):
        self.head, self.batch_size, self.k = head, batch_size, k
        if head.target_ref and head.target_ref[0].fused and not head.fused:
            head.use_fused_kernels()  # the target's fused kernels for the draft's layers too
        self.cache = head.new_cache(batch_size)
        self.buf: dict[str, Tensor] = allocate(self.state_specs(k), batch_size, next(head.parameters()).device)

    @property
    def attention_kernel(self) -> bool:
        return self.head.attention_kernel

    def graph_meta(self) -> dict:
        return self.head.graph_meta()

    def state_specs(self, k: int) -> dict:
        """name -> engine.graphs.runner.InputSpec (per row, state) of the draft's own buffers."""
        return {}

    def propose_steps(self, cache, k: int) -> list:
        raise NotImplementedError

    def commit_steps(self, cache, k: int) -> list:
        raise NotImplementedError

    # -- alone, eagerly (tests, tools): the same steps over an env built from the host state ----------
    def _env(self, state: SpecState) -> dict:
        b = len(state.lengths)
        lengths, live = state.on_device()
        last = torch.tensor([h[-1] for h in state.history], device=lengths.device)
        return {
            "lengths": lengths,
            "live": live,
            "last": last,
            "kv_len": max(state.lengths),
            **{name: t[:b] for name, t in self.buf.items()},
        }

    def propose(self, state: SpecState, k: int) -> Proposal:
        env = self._env(state)
        env["draft"] = torch.zeros(len(state.lengths), k, dtype=torch.long, device=env["lengths"].device)
        run_steps(self.propose_steps(self.cache.rows(len(state.lengths)), k), env)
        return Proposal(env["draft"])

    def commit(self, state: SpecState, feats: Optional[Tensor], emitted: Tensor, accepted: Tensor) -> None:
        """Draft extend, before `state` advances (state.lengths[r] = L, the verify's first position).
        emitted [b, k+1]: d_1..d_a then the bonus at index a (the rest is garbage); accepted [b] = a;
        feats [b, k+1, F] at positions L..L+k."""
        env = self._env(state)
        env.update({FEATURE_KEYS[self.features]: feats, "emitted": emitted, "accepted": accepted})
        run_steps(self.commit_steps(self.cache.rows(len(state.lengths)), emitted.shape[1] - 1), env)


def write_rows(buf: Tensor, value: Tensor, rows: Optional[slice]) -> None:
    """A draft state buffer's rows after a prefill: `rows`, or the first n (a fresh batch of n rows)."""
    buf[rows if rows is not None else slice(0, value.shape[0])] = value
