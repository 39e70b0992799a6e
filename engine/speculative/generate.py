"""Batched generation over the target's static KV cache: plain decoding and draft-and-verify, one loop.

    prefill  tokens [b, T] (right-padded), positions [b, T], valid = position < prompt_len
    round    engine/speculative/round.py: [x_L, d_1..d_k] at L..L+k, verified; k = 0 is one decode step

`SpecDecoder` is the host side of a round: the prefill, the rows' start (their sampling settings into
the round's state buffers, the first token, the draft prefill), and one round (a host draft's
proposal in, the round replayed or run eagerly, its `out` copied to the host once, the host mirror
`SpecState` advanced). Rollback is free: validity is by position, so rejected slots are overwritten
later; finished rows ride along writing the dummy slot. `Generator.generate` (eval) and
engine/serve/scheduler.py (serve) drive it, so served greedy outputs are the eval's, token for token.
With adaptive k at k = 0 a join's draft prefill waits for the next drafting round (k = 0 rounds read
no draft state); a later join on the same rows replaces it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from engine.drafts.base import Draft, FeatureKind, RoundState, SpecState
from engine.errors import ConfigError
from engine.graphs.breakable import phases
from engine.graphs.runner import CaptureHiddenMode, GraphRunner
from engine.model import ForwardOutput, LlamaModel, StaticKVCache
from engine.ops import Live
from engine.sampling import BONUS, Draws, RowSettings, SamplingParams, draw, seeds_from
from engine.speculative.adaptive_k import AdaptiveK, Mix, measure_round_costs
from engine.speculative.graph_set import GraphSet, draft_prefill_name, round_name
from engine.speculative.phase_clock import PhaseClock
from engine.speculative.round import Round, round_buffers


@dataclass
class SequenceResult:
    tokens: list[int]  # generated tokens (the stop token included when it ended the sequence)
    prompt_len: int
    ttft_s: float  # batch start -> first token on the host
    decode_s: float  # first token -> last token
    finish_reason: str  # "stop" | "length"
    accepts: list[int] = field(default_factory=list)  # per verify round: draft tokens accepted (a)

    @property
    def tpot_s(self) -> Optional[float]:
        n = len(self.tokens)
        return self.decode_s / (n - 1) if n > 1 else None


@dataclass
class RoundStats:
    """Accumulated over a generator's batches: rounds and where their time went (stream time between
    CUDA events at the phase boundaries of engine/speculative/round.py, engine/speculative/phase_clock.py)."""

    rounds: int = 0
    draft_s: float = 0.0  # draft chain + draft extend
    verify_s: float = 0.0  # target verify + accept (a decode step when there is no draft)
    extend_s: float = 0.0  # the draft extend alone (part of draft_s)
    host_s: float = 0.0  # the stream idle between rounds of a batch: the host's sync and bookkeeping

    @property
    def round_s(self) -> float:
        return self.draft_s + self.verify_s


def check_capacity(prompt_lens: list[int], max_new_tokens: int, max_seq_len: int, num_steps: int = 0) -> None:
    worst = max(prompt_lens)
    need = worst + max_new_tokens + num_steps
    if need > max_seq_len:
        extra = f" + draft.num_steps={num_steps}" if num_steps else ""
        raise ConfigError(
            "model.max_seq_len",
            max_seq_len,
            f"a prompt of {worst} tokens + eval.max_new_tokens={max_new_tokens}{extra} does not fit the KV cache",
            f">= {need}, or a smaller eval.max_new_tokens",
        )


def _rows(rows: slice | list[int]) -> list[int]:
    return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else list(rows)


def runs(rows: list[int]) -> list[tuple[int, int]]:
    """Rows -> (first, count) of each run of consecutive ones, in order."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][0] + out[-1][1] == r:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((r, 1))
    return out


def _features(out: ForwardOutput, kind: FeatureKind) -> Optional[Tensor]:
    if kind == FeatureKind.aux:
        if out.aux_hidden_states is None:
            raise RuntimeError(
                "the draft reads aux hidden states but the target captures none: "
                "configure_aux_capture must run before generation"
            )
        return out.aux_hidden_states
    return out.hidden_states if kind == FeatureKind.final else None


@dataclass
class Prefill:
    out: ForwardOutput  # logits [b, 1, vocab] (each row's last prompt position), features [b, T, F]
    tokens: Tensor  # [b, T] right-padded prompt ids
    valid: Tensor  # [b, T] bool
    embeds: Optional[Tensor]  # [b, T, hidden] when the prompts came as embeddings, else None

    def part(self, i: int, j: int) -> "Prefill":
        """Prompts i..j-1 alone (views)."""
        o, cut = self.out, lambda x: None if x is None else x[i:j]  # noqa: E731
        out = ForwardOutput(*(cut(x) for x in (o.logits, o.hidden_states, o.aux_hidden_states, o.input_embeds, o.ids)))
        return Prefill(out, self.tokens[i:j], self.valid[i:j], cut(self.embeds))


def _pad_rows(parts: list[Optional[Tensor]], width: int) -> Optional[Tensor]:
    """[n_i, t_i, ...] per group of prompts -> [sum n_i, width, ...], zero (False) beyond each group's t_i
    (None when the parts are)."""
    if parts[0] is None:
        return None
    out = parts[0].new_zeros(sum(x.shape[0] for x in parts), width, *parts[0].shape[2:])
    r = 0
    for x in parts:
        out[r : r + x.shape[0], : x.shape[1]] = x
        r += x.shape[0]
    return out


def _stack_outputs(outs: list[ForwardOutput], width: int) -> ForwardOutput:
    """Each group's prefill -> the joint prefill's output (logits at each prompt's last position)."""
    return ForwardOutput(
        torch.cat([o.logits for o in outs]),  # [n, 1, vocab]
        _pad_rows([o.hidden_states for o in outs], width),
        _pad_rows([o.aux_hidden_states for o in outs], width),
        _pad_rows([o.input_embeds for o in outs], width),
    )


def _stack_embeds(ones: list["Prefill"], width: int) -> Optional[Tensor]:
    return None if any(x.embeds is None for x in ones) else _pad_rows([x.embeds for x in ones], width)


@dataclass
class RoundResult:
    accepted: list[int]  # per row: draft tokens kept (a); 0 for rows not live
    emitted: list[list[int]]  # per row: the a + 1 tokens the round emitted ([] for rows not live)
    time: float  # perf_counter() when the tokens reached the host
    k: int = 0  # the round's draft tokens
    put_off_s: float = 0.0  # host wall time of the joins' put-off draft prefills it ran first (a join's time)


def sync(device: torch.device) -> None:
    """Wait for the device (timings); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpecDecoder:
    """Prefill, draft prefill and draft-and-verify rounds over a static cache of `batch_size` rows.

    A round is the device program of engine/speculative/round.py over state buffers (last, lengths, live, the
    draft's own): with `graphs` their round runner replays it (falling back to eager by itself for a
    batch larger than the largest capture size: the caller never reads a graph buffer), without it
    runs eagerly over buffers allocated here. The host keeps a mirror of the state (`SpecState`: the
    histories, lengths and live flags) and pushes only what it changes itself: the live flags of rows
    that finished, and the rows a prefill starts.
    """

    def __init__(
        self,
        model: LlamaModel,
        batch_size: int,
        draft: Optional[Draft] = None,
        num_steps: int = 0,
        graphs: Optional[GraphSet] = None,
        cache: Optional[StaticKVCache] = None,  # without graphs: the target's cache to reuse (another decoder's)
    ):
        self.model, self.batch_size = model, batch_size
        self.draft, self.k = draft, (num_steps if draft is not None else 0)  # k: the most drafts a round takes
        self.device = model.lm_head.weight.device
        self.rounds, self.clock = 0, PhaseClock(self.device)
        self.runners: dict[tuple[int, bool], object] = {}  # (k, sampled) -> round runner
        self.prefill_runner, self.prefill_cache = None, None
        self.draft_prefills: dict[bool, Optional[GraphRunner]] = {}  # sampled -> the draft's prefill runner
        self.draft_prefill_cache = None
        self.adaptive: Optional[AdaptiveK] = (
            None  # set: each round's k from the load (engine/speculative/adaptive_k.py)
        )
        self.ks_used: Counter = Counter()  # rounds per k
        device_draft = draft if draft is not None and draft.on_device else None
        if graphs is not None:  # the graphs replay over the set's cache and buffers: use them
            if graphs.batch_size < batch_size:
                raise ValueError(f"graphs hold {graphs.batch_size} rows, this generator {batch_size}")
            if self.k not in graphs.round_ks or (device_draft is not None and graphs.draft is not device_draft):
                raise ValueError(
                    f"graphs were captured for rounds of k in {graphs.round_ks} and their own draft; "
                    f"this generator runs k={self.k}" + (" with another draft" if device_draft else "")
                )
            self.cache, self.buffers = graphs.cache, graphs.buffers
            self.runners = {
                (k, s): graphs.get(round_name(k, s))
                for k in graphs.round_ks
                if k <= self.k
                for s in (False, True)
                if graphs.get(round_name(k, s)) is not None
            }
            self.prefill_runner, self.prefill_cache = graphs.get("prefill"), graphs.prefill_cache
            self.draft_prefills = {s: graphs.get(draft_prefill_name(s)) for s in (False, True)}
            self.draft_prefill_cache = graphs.draft_prefill_cache
            self.policies = (graphs.target_policy, graphs.draft_policy)
        else:
            self.cache = cache if cache is not None else model.new_cache(batch_size)
            self.buffers = round_buffers(self.k, device_draft, batch_size, self.device)
            self.policies = ("none", "none")
        self.device_draft = device_draft
        self.sampled = [False] * batch_size  # host mirror: which rows sample (a round of any: the sampled program)
        self.speculating = [True] * batch_size  # host mirror of the `speculate` buffer (written at start)
        self._behind = [False] * batch_size  # rows whose draft missed a round (k = 0): its next proposal is stale
        self._put_off: list[tuple[set[int], slice, tuple]] = []  # draft prefills a k = 0 policy put off (below)
        self._last_k: Optional[int] = None  # the last round's k
        self._t_end: Optional[float] = None  # perf_counter() at the last round's end (None: a prefill since)
        self.kind = draft.features if draft is not None else FeatureKind.none  # target features it reads
        self.mode = CaptureHiddenMode.FULL if self.kind != FeatureKind.none else CaptureHiddenMode.NULL
        self._rounds: dict[tuple[int, int, bool], Round] = {}  # (rows, k, sampled) -> the eager round
        self._last_end = None  # the clock mark at the end of the last round of the running batch
        self.phase_hook = None  # called with each phase's name as it begins, then None (profilers)
        pin = self.device.type == "cuda"
        self._out_host = torch.empty(batch_size, self.k + 2, dtype=torch.long, pin_memory=pin)
        self._live_host = torch.empty(batch_size, dtype=torch.bool, pin_memory=pin)

    @property
    def stats(self) -> RoundStats:
        """Rounds so far and where their stream time went (settles the last round's spans)."""
        sec = self.clock.totals()
        extend = sec.get("extend", 0.0)
        return RoundStats(
            self.rounds, sec.get("draft", 0.0) + extend, sec.get("verify", 0.0), extend, sec.get("host", 0.0)
        )

    def reset_stats(self) -> None:
        self.rounds = 0
        self.ks_used.clear()
        self.clock.reset()

    def prefill(self, prompts: list[list[int]], prompt_embeds, rows: Optional[slice | list[int]] = None) -> Prefill:
        """The target's prefill of `prompts` into cache rows `rows` (None: rows 0..b-1; else a slice, or any
        rows, in the prompts' order). Through the prefill graphs where a bucket holds them: over the round
        cache's first rows, or over the graph set's staging cache, whose KV then goes into `rows` (a
        server's joins, at whichever slots are free; more prompts than the staging rows hold at their
        length go through them in groups, one at a time at worst); else eagerly, a run of contiguous rows
        at a time (counted as a fallback when the graphs write the round cache)."""
        b, dev = len(prompts), self.device
        slots = list(range(b)) if rows is None else _rows(rows)
        width = max(len(p) for p in prompts)
        runner, staged = self.prefill_runner, self.prefill_cache not in (None, self.cache)
        if runner is not None and staged:
            at_once = runner.rows_for(width)  # staging rows at this width
            if 0 < at_once < b:
                return self._prefill_parts(prompts, prompt_embeds, slots, [at_once] * (b // at_once) + [b % at_once])
            if not at_once:
                runner = None  # no bucket holds these prompts
        elif runner is not None and slots[0]:
            runner = None  # the graphs write rows 0..b-1 of the round cache
        if runner is None and len(runs(slots)) > 1:  # an eager prefill writes contiguous rows
            return self._prefill_parts(prompts, prompt_embeds, slots, [n for _, n in runs(slots)])
        ids = [t for p in prompts for t in (*p, *[0] * (width - len(p)))] + [len(p) for p in prompts]
        flat = torch.tensor(ids).to(dev)  # the right-padded ids, then the lengths: one copy
        tokens, lens = flat[: b * width].view(b, width), flat[b * width :]  # [b, width], [b]
        positions = torch.arange(width, device=dev).expand(b, width)  # [b, width]
        valid = positions < lens[:, None]
        given = prompt_embeds is not None and any(e is not None for e in prompt_embeds)
        embeds = None
        if given or runner is not None:  # the prefill graphs take embeddings
            embeds = self.model.embed(tokens)  # [b, width, hidden]: what the first layer takes
            for i, e in enumerate(prompt_embeds or []):
                if e is not None:
                    embeds[i, : e.shape[0]] = e.to(embeds.dtype)
        live = {
            "tokens": tokens,
            "positions": positions,
            "valid": valid,
            "input_embeds": embeds,
            "logits_index": lens - 1,
        }
        if runner is None:
            out = self.model(
                tokens,
                positions,
                self.cache.rows(slice(slots[0], slots[0] + b)),
                valid=valid,
                kv_len=width,
                input_embeds=embeds,
                logits_index=live["logits_index"],
                causal=True,  # fresh rows from position 0: SDPA's causal kernel, no [t, t] mask
            )
        else:
            got, _ = runner(live, width, self.mode)
            out = ForwardOutput(got["logits"], got.get("hidden"), got.get("aux"), got.get("embeds"))
            if staged:  # the staged KV into the requests' rows
                self.cache.put(self.prefill_cache, slots, width)
        return Prefill(out, tokens, valid, embeds if given else None)

    def _prefill_parts(self, prompts, prompt_embeds, slots: list[int], sizes: list[int]) -> Prefill:
        """`prefill` of consecutive groups of `sizes` prompts, one call each, stacked into one Prefill."""
        parts, i = [], 0
        for n in filter(None, sizes):
            embeds = None if prompt_embeds is None else prompt_embeds[i : i + n]
            parts.append(self.prefill(prompts[i : i + n], embeds, slots[i : i + n]))
            i += n
        width = max(len(p) for p in prompts)
        return Prefill(
            _stack_outputs([x.out for x in parts], width),
            _pad_rows([x.tokens for x in parts], width),
            _pad_rows([x.valid for x in parts], width),
            _stack_embeds(parts, width),
        )

    def start(self, state: SpecState, pre: Prefill, settings: RowSettings, rows: Optional[slice] = None) -> Tensor:
        """After the target's prefill: the rows' settings into the round's state buffers, their first token
        drawn from the prefill's logits (x_L at position L, stream BONUS: what a round without drafts draws
        there), then `begin`. rows as in `begin`. -> the first tokens [n] (on the device)."""
        n = len(settings.seed)
        sl = rows if rows is not None else slice(0, n)
        settings.write(self.buffers, sl)
        if self.device_draft is not None:
            self.device_draft.keep_temperatures(self.buffers["temperature"][sl], sl)
        self.sampled[sl], self.speculating[sl] = settings.sampled, list(settings.speculate)
        if not any(settings.sampled):  # greedy rows: the argmax (one launch)
            first = pre.out.logits[:, -1].argmax(-1)  # [n]
            self.begin(state, pre, first, rows)
            return first
        draws = Draws(self.buffers["temperature"][sl], self.buffers["top_p"][sl], self.buffers["seed"][sl])
        first = draw(pre.out.logits, draws, pre.valid.sum(1), BONUS, kernels=self.model.fused)[:, 0]  # [n]
        self.begin(state, pre, first, rows, draws)
        return first

    def begin(
        self,
        state: SpecState,
        pre: Prefill,
        first: Tensor,
        rows: Optional[slice] = None,
        draws: Optional[Draws] = None,
    ) -> None:
        """After the target's prefill: the round state of these rows (lengths, last = the first token,
        live) and the draft's prefill (draws: the rows' sampling when some of them sample). rows: where in
        the batch the prompts sit (None: a fresh batch of exactly these prompts, rows 0..n-1; the rows
        after them are padding)."""
        n = first.shape[0]
        sl = rows if rows is not None else slice(0, n)
        self._last_end = self._t_end = None  # a prefill is no host gap between rounds
        self._behind[sl] = [False] * n
        lens = pre.valid.sum(1)  # [n]
        self.buffers["last"][sl] = first
        self.buffers["lengths"][sl] = lens
        self.buffers["live"][sl] = True
        if rows is None:
            self.buffers["live"][n:] = False
        if self.draft is not None:
            args = (state, _features(pre.out, self.kind), pre.tokens, pre.valid, pre.embeds, first, draws)
            mine = set(range(sl.start, sl.stop))
            for owned, _, _ in self._put_off:  # a prefill put off for these rows is theirs no more
                owned -= mine
            self._put_off = [p for p in self._put_off if p[0]]
            if self.adaptive is not None and self.device_draft is not None and self._last_k == 0:
                self._put_off.append((mine, sl, args))  # k = 0 rounds read no draft: prefill at the next k > 0
            else:
                self._draft_begin(*args[:6], rows, draws)

    def _draft_begin(self, state, feats, tokens, valid, embeds, first, rows: Optional[slice], draws) -> None:
        """The draft's prefill: through its prefill graphs where a bucket holds the prompts (over the
        draft's cache rows 0..n-1, or its staging rows, whose KV then goes into `rows`; more prompts than
        the staging rows hold at their width go through them in groups), else eagerly."""
        n, width = tokens.shape
        sl = rows if rows is not None else slice(0, n)
        d = self.device_draft
        sampled = draws is not None and d is not None and d.draws_at_prefill
        runner = self.draft_prefills.get(sampled)
        staged = runner is not None and self.draft_prefill_cache is not d.cache
        fits = runner is not None and runner.bucket_for(n, width) is not None
        at_once = runner.rows_for(width) if staged and not fits else 0
        # eager: no graph, prompts as embeddings, rows past 0 without a staging row (the graphs write
        # rows 0..b-1), or no bucket that holds the prompts even one at a time
        if embeds is not None or not staged and sl.start or not (fits or at_once):
            self.draft.begin(state, feats, tokens, valid, embeds, first, rows=rows, draws=draws)
            return
        if at_once:
            for i in range(0, n, at_once):  # a group the staging rows hold at a time
                j, row = slice(i, min(i + at_once, n)), slice(sl.start + i, sl.start + min(i + at_once, n))
                part = None if draws is None else draws.rows(j)
                self._draft_begin(state, feats[j], tokens[j], valid[j], None, first[j], row, part)
            return
        live = {
            "tokens": tokens,
            "positions": torch.arange(width, device=self.device).expand(n, width),
            "valid": valid,
            "feats": feats,
            "first": first,
            **({"temperature": draws.temperature, "top_p": draws.top_p, "seed": draws.seed} if sampled else {}),
        }
        out, _ = runner(live, width, clone=False)  # views of its static outputs, written into the rows at once
        if staged:
            d.cache.rows(sl).take(self.draft_prefill_cache, width)
        d.settle(out, rows)

    def _begin_put_off(self, state: SpecState) -> None:
        """The draft prefills put off while rounds ran k = 0, for the rows still live that they still own,
        before a drafting round (their draft then stands at the prompt's end: behind, if a round ran since)."""
        for owned, sl, (st, feats, tokens, valid, embeds, first, draws) in self._put_off:
            rows = [r for r in range(sl.start, sl.stop) if r in owned and state.live[r]]
            for i, n in runs(rows):  # each run of contiguous rows in one prefill: [i, i + n)
                j = slice(i - sl.start, i - sl.start + n)
                part = None if draws is None else draws.rows(j)
                row_embeds = embeds[j] if embeds is not None else None
                self._draft_begin(st, feats[j], tokens[j], valid[j], row_embeds, first[j], slice(i, i + n), part)
        self._put_off = []

    def push_live(self, state: SpecState) -> None:
        """The host's live flags (rows that finished or left) to the device, for the next round."""
        b = len(state.live)
        self._live_host[:b] = torch.tensor(state.live)
        self.buffers["live"][:b].copy_(self._live_host[:b], non_blocking=True)

    def _round(self, b: int, k: int, sampled: bool) -> Round:
        key = (b, k, sampled)
        if key not in self._rounds:
            self._rounds[key] = Round(self.model, self.cache, self.device_draft, k, b, sampled, self.policies)
        return self._rounds[key]

    def run_round(
        self,
        b: int,
        kv_len: int,
        sampled: bool = False,
        draft_tokens: Optional[Tensor] = None,
        on_phase=None,
        state: Optional[SpecState] = None,
        k: Optional[int] = None,
    ) -> Tensor:
        """One round of k drafts (default: the generator's) over rows 0..b-1 of the state buffers, on the
        device; -> out [b, k+2] (a view of the state buffer, valid until the next round). sampled: the
        program whose rows each follow their own sampling (else every row greedy); draft_tokens [b, k]: a
        host draft's proposal; state: the host mirror, for eager steps that read it."""
        k = self.k if k is None else k
        host = {"kv_len": kv_len, "state": state}
        if draft_tokens is not None:
            self.buffers["draft"][:b, :k].copy_(draft_tokens)
        runner = self.runners.get((k, sampled))
        if runner is not None:
            out, _ = runner({}, kv_len, self.mode, rows=b, host=host, on_phase=on_phase, clone=False)
            return out["out"][:, : k + 2]
        s = RoundState.of({**{name: t[:b] for name, t in self.buffers.items()}, "state": state})
        with phases(on_phase):
            self._round(b, k, sampled)(s, Live(kv_len))
        return s.out[:, : k + 2]

    @torch.inference_mode()
    def enable_adaptive_k(self, sizes: list[int], prior: float = 0.7, sampled: bool = False) -> AdaptiveK:
        """Measure a round of every k in 0..k over each capture size (rows that are not live: every
        write goes to the dummy slot), greedy and with `sampled` the sampled variant too, then pick each
        round's k from those costs and what served rounds cost (engine/speculative/adaptive_k.py)."""
        ks = sorted({k for k, _ in self.runners} or range(self.k + 1))
        self.buffers["live"].fill_(False)
        costs = [
            measure_round_costs(lambda b, k, s=s: self.run_round(b, 1, s, k=k), sizes, ks, self.device)
            for s in ((False, True) if sampled else (False,))
        ]
        self.adaptive = AdaptiveK(costs[0], self.k, prior, sampled_costs=costs[-1] if sampled else None)
        return self.adaptive

    def _mix(self, state: SpecState, b: int, sampled_round: bool) -> Mix:
        """The round's live rows by what a draft buys them (adaptive k)."""
        spec = [i for i in range(b) if state.live[i] and self.speculating[i]]
        g = sum(not self.sampled[i] for i in spec)
        return Mix(g, len(spec) - g, sum(state.live[:b]) - len(spec), sampled_round)

    def round(self, state: SpecState, rows: Optional[int] = None) -> RoundResult:
        """One round over the first `rows` rows of `state` (default: all): propose k, verify k + 1, accept,
        draft extend, advance the live rows' history and lengths (host mirror). k is the generator's, or
        with adaptive k the policy's for these rows and their mix; the sampled program when a live row
        samples. The round's one sync: its `out` to the host."""
        t0, b, clock = time.perf_counter(), rows or len(state.lengths), self.clock
        sampled = any(s and live for s, live in zip(self.sampled[:b], state.live[:b]))
        k, mix = self.k, None
        if self.adaptive is not None:
            mix = self._mix(state, b, sampled)
            k = self.adaptive.choose(b, mix)
        put_off_s, host_end = 0.0, None
        if k and self._put_off:  # the joins' draft prefills: neither this round's time nor the host's gap
            t1, host_end = time.perf_counter(), clock.mark()
            self._begin_put_off(state)
            clock.span("join_draft", host_end, clock.mark())  # a join's phase (the server's summary)
            put_off_s = time.perf_counter() - t1
        self._last_k = k
        marks: list[tuple[str, object]] = [("draft", clock.mark())]
        if self._last_end is not None:  # the stream waited for the host since the last round
            clock.span("host", self._last_end, host_end if host_end is not None else marks[0][1])
        draft_tokens = None
        if self.draft is not None and self.device_draft is None and k:  # a host draft proposes on the host
            draft_tokens = self.draft.propose(state, k).tokens[:b]

        def on_phase(phase: str) -> None:
            marks.append((phase, clock.mark()))
            if self.phase_hook is not None:
                self.phase_hook(phase)

        out = self.run_round(b, max(state.lengths[:b]), sampled, draft_tokens, on_phase=on_phase, state=state, k=k)
        host_out = self._out_host.view(-1)[: b * (k + 2)].view(b, k + 2)  # contiguous, pinned
        host_out.copy_(out, non_blocking=True)
        end = self._last_end = clock.mark()
        if self.phase_hook is not None:
            self.phase_hook(None)
        sync(self.device)  # the round's one device -> host copy
        now = time.perf_counter()
        self.rounds += 1
        for (phase, start), (_, stop) in zip(marks, marks[1:] + [("", end)]):
            clock.span(phase, start, stop)
        clock.settle(keep=(end,))  # the next round's host span starts at this round's end

        acc, new = [0] * b, [[] for _ in range(b)]
        for i, row in enumerate(host_out.tolist()):
            if state.live[i]:
                acc[i], new[i] = row[0], row[1 : row[0] + 2]
                state.history[i] += new[i]
                state.lengths[i] += len(new[i])
        self.ks_used[k] += 1
        if self.adaptive is not None:
            host_s = t0 - self._t_end if self._t_end is not None else None
            self._observe(state, b, k, mix, acc, now - t0 - put_off_s, host_s)
        self._t_end = now
        if self.device_draft is not None:  # a k = 0 round leaves the draft behind; a drafting round catches up
            self._behind[:b] = [k == 0 and live for live in state.live[:b]]
        return RoundResult(acc, new, now, k, put_off_s)

    def _observe(self, state: SpecState, b: int, k: int, mix: Mix, acc: list[int], round_s: float, host_s) -> None:
        """What adaptive k learns from a round: its time, and the acceptance of the rows that speculated
        on a current draft."""
        self.adaptive.observe_cost(b, k, mix.sampled_round, round_s, host_s)
        seen = [i for i in range(b) if state.live[i] and self.speculating[i] and not self._behind[i]]
        self.adaptive.observe(
            k, [acc[i] for i in seen if not self.sampled[i]], [acc[i] for i in seen if self.sampled[i]]
        )


class Generator(SpecDecoder):
    """Generation for batches of up to `batch_size` prompts, with an optional draft of k tokens."""

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        generator: Optional[torch.Generator] = None,
        prompt_embeds: Optional[list[Optional[Tensor]]] = None,  # per prompt [len, hidden], or None
        row_ids: Optional[list[int]] = None,  # each prompt's index in the whole set (the oracle reads it)
        sync_every: int = 1,  # without a draft: steps between host looks (_decode_on_device when > 1)
        seeds: Optional[list[int]] = None,  # each row's seed (None: drawn from `generator` when sampling)
    ) -> list[SequenceResult]:
        b, k = len(prompts), self.k
        if not 0 < b <= self.batch_size:
            raise ValueError(f"batch of {b} prompts; this generator holds 1..{self.batch_size}")
        lens = [len(p) for p in prompts]
        if min(lens) == 0:
            raise ValueError("empty prompt")
        check_capacity(lens, params.max_new_tokens, self.model.max_seq_len, k)
        stop = frozenset() if params.ignore_eos else stop_ids
        if seeds is None:
            seeds = [0] * b if params.greedy else seeds_from(generator, b)
        settings = RowSettings.uniform(params, seeds)
        state = SpecState(
            [list(p) for p in prompts],
            list(lens),
            [True] * b,
            row_ids if row_ids is not None else list(range(b)),
            self.device,
        )

        t0 = time.perf_counter()
        pre = self.prefill(prompts, prompt_embeds)
        last = self.start(state, pre, settings)  # [b]
        if k == 0 and sync_every > 1:
            return self._decode_on_device(lens, not params.greedy, params.max_new_tokens, stop, sync_every, t0)

        outs: list[list[int]] = [[] for _ in range(b)]
        accepts: list[list[int]] = [[] for _ in range(b)]
        first_t, last_t = [0.0] * b, [0.0] * b

        def emit(new: list[list[int]], now: float) -> bool:
            """Hand out new tokens; -> whether a row finished (its live flag goes to the device)."""
            finished = False
            for i, toks in enumerate(new):
                if not state.live[i]:
                    continue
                for tok in toks:
                    outs[i].append(tok)
                    if tok in stop or len(outs[i]) >= params.max_new_tokens:
                        state.live[i], finished = False, True
                        break
                first_t[i] = first_t[i] or now
                last_t[i] = now
            return finished

        first = last.tolist()
        if emit([[t] for t in first], time.perf_counter()):
            self.push_live(state)
        for i, t in enumerate(first):
            state.history[i].append(t)
        while any(state.live):
            was_live = list(state.live)
            r = self.round(state)
            if emit(r.emitted, r.time):
                self.push_live(state)
            for i in range(b):
                if was_live[i]:
                    accepts[i].append(r.accepted[i])

        return [
            SequenceResult(
                tokens=outs[i],
                prompt_len=lens[i],
                ttft_s=first_t[i] - t0,
                decode_s=last_t[i] - first_t[i],
                finish_reason="stop" if outs[i][-1] in stop else "length",
                accepts=accepts[i],
            )
            for i in range(b)
        ]

    def _decode_on_device(
        self, lens: list[int], sampled: bool, max_new: int, stop: frozenset[int], sync_every: int, t0: float
    ) -> list[SequenceResult]:
        """Plain decoding with the bookkeeping on the device, for large batches (self-distillation).

        The round loop copies every step's tokens to the host and walks the rows in Python (about 2 ms a
        step at 1024 rows on a CI core, with the device idle meanwhile). Here the stop test and the token
        table stay on the device too; the host looks every `sync_every` steps, only to see whether every
        row is done, and the tokens come back once. Each step is the round loop's round (k = 0), so the
        tokens are the same; a row's finish time is known to within `sync_every` steps.

        Buffers: out [b, max_new + 1] (column max_new takes the writes of finished rows), count [b]
        (tokens emitted); the round's state (last: the prefill's token, lengths, live) advances itself.
        """
        b, dev = len(lens), self.device
        rows = torch.arange(b, device=dev)
        last, live = self.buffers["last"][:b], self.buffers["live"][:b]
        out = torch.zeros(b, max_new + 1, dtype=torch.long, device=dev)  # [b, max_new + 1]
        out[:, 0] = last
        count = torch.ones(b, dtype=torch.long, device=dev)  # [b]
        stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=dev)
        live &= ~torch.isin(last, stop_ids) & (count < max_new)
        live_host = live.tolist()
        first_t = time.perf_counter()
        done_t = [first_t] * b
        step, longest = 0, max(lens)  # steps run (every row is done after max_new - 1); the kv bound
        while any(live_host) and step < max_new - 1:
            t_step = self.clock.mark()
            for _ in range(min(sync_every, max_new - 1 - step)):
                was = live.clone()
                self.run_round(b, longest + step, sampled)  # last <- each live row's token
                out[rows, torch.where(was, count, max_new)] = last
                count += was
                live &= ~torch.isin(last, stop_ids) & (count < max_new)
                step += 1
            t_end = self.clock.mark()
            now_live = live.tolist()
            now = time.perf_counter()
            self.clock.span("verify", t_step, t_end)
            self.clock.settle()
            for i, (was_on, is_on) in enumerate(zip(live_host, now_live)):
                if was_on and not is_on:
                    done_t[i] = now
            live_host = now_live
        self.rounds += step
        tokens = [row[:n] for row, n in zip(out.tolist(), count.tolist())]
        return [
            SequenceResult(
                tokens=t,
                prompt_len=n,
                ttft_s=first_t - t0,
                decode_s=done - first_t,
                finish_reason="stop" if t[-1] in stop else "length",
                accepts=[0] * (len(t) - 1),
            )
            for t, n, done in zip(tokens, lens, done_t)
        ]
