"""Batched generation over the target's static KV cache: plain decoding and draft-and-verify, one loop.

A round proposes k draft tokens (k = 0 without a draft), runs one target forward over the last
emitted token and the drafts, verifies, and emits the accepted tokens plus one bonus token. With
k = 0 a round is exactly one decode step, so the baseline and every draft share the prefill, the
bookkeeping (stop tokens, max_new_tokens, timings) and the cache discipline below.

    prefill  tokens [b, T] (right-padded)  positions [b, T]   valid = position < prompt_len
    round    tokens [b, k+1] = [x_L, d_1..d_k]   positions L..L+k   valid = row still live

Rollback after a partial acceptance is free: validity is by position (a query at p sees cache slots
0..p of its row), so slots written for rejected drafts are simply overwritten later. Finished rows
ride along as padding and write to the cache's dummy slot. Host-side state (lengths, histories) is
plain Python; each round has one device->host copy of the emitted tokens, which also timestamps them.

`SpecDecoder` holds the parts every caller shares: the prefill forward, the draft prefill and one
round (propose -> verify -> commit -> advance the host state) over a batch of rows. Two callers drive it:

    Generator.generate   eval: a batch of prompts from prefill to the last token (below)
    engine.scheduler     serve: a fixed set of slots that requests join and leave between rounds

so served outputs at temperature 0 are the eval outputs, token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from engine.drafts.base import Draft, FeatureKind, SpecState
from engine.errors import ConfigError
from engine.graphs.graph_set import GraphSet
from engine.graphs.runner import CaptureHiddenMode
from engine.model import ForwardOutput, LlamaModel
from engine.phase_clock import PhaseClock
from engine.sampling import RowSampling, SamplingParams, as_rows, sample
from engine.verify import verify


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
    """Accumulated over a generator's batches: rounds (draft + verify) and where their time went
    (stream time, engine/phase_clock.py)."""

    rounds: int = 0
    draft_s: float = 0.0  # draft propose + draft extend
    verify_s: float = 0.0  # target verify forwards (a decode step when there is no draft)


def check_capacity(prompt_lens: list[int], max_new_tokens: int, max_seq_len: int, num_steps: int = 0) -> None:
    worst = max(prompt_lens)
    need = worst + max_new_tokens + num_steps
    if need > max_seq_len:
        extra = f" + draft.num_steps={num_steps}" if num_steps else ""
        raise ConfigError(
            "model.max_seq_len", max_seq_len,
            f"a prompt of {worst} tokens + eval.max_new_tokens={max_new_tokens}{extra} does not fit the KV cache",
            f">= {need}, or a smaller eval.max_new_tokens",
        )


def _features(out: ForwardOutput, kind: FeatureKind) -> Optional[Tensor]:
    if kind == FeatureKind.aux:
        if out.aux_hidden_states is None:
            raise RuntimeError("the draft reads aux hidden states but the target captures none: "
                               "configure_aux_capture must run before generation")
        return out.aux_hidden_states
    return out.hidden_states if kind == FeatureKind.final else None


@dataclass
class Prefill:
    out: ForwardOutput  # logits [b, 1, vocab] (each row's last prompt position), features [b, T, F]
    tokens: Tensor  # [b, T] right-padded prompt ids
    valid: Tensor  # [b, T] bool
    embeds: Optional[Tensor]  # [b, T, hidden] when the prompts came as embeddings, else None


@dataclass
class RoundResult:
    accepted: list[int]  # per row: draft tokens kept (a); 0 for rows not live
    emitted: list[list[int]]  # per row: the a + 1 tokens the round emitted ([] for rows not live)
    bonus: Tensor  # [b] the last emitted token of every row: the next round's first input
    time: float  # perf_counter() when the tokens reached the host


def sync(device: torch.device) -> None:
    """Wait for the device (timings); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpecDecoder:
    """Prefill, draft prefill and draft-and-verify rounds over a static cache of `batch_size` rows.

    With `graphs` the rounds (and a piecewise prefill) replay the set's runners over the set's cache,
    falling back to eager by themselves (a batch larger than the largest capture size): the caller
    never reads a graph buffer. Without, everything runs eagerly over a cache allocated here.
    """

    def __init__(self, model: LlamaModel, batch_size: int, draft: Optional[Draft] = None, num_steps: int = 0,
                 graphs: Optional[GraphSet] = None):
        self.model, self.batch_size = model, batch_size
        self.draft, self.k = draft, (num_steps if draft is not None else 0)
        self.device = model.lm_head.weight.device
        self.rounds, self.clock = 0, PhaseClock(self.device)
        self.round_runner = self.prefill_runner = None
        if graphs is not None:  # the graphs replay over the set's cache: use it
            if graphs.batch_size < batch_size:
                raise ValueError(f"graphs hold {graphs.batch_size} rows, this generator {batch_size}")
            self.cache = graphs.cache
            self.round_runner = graphs.get("verify" if self.k > 0 else "decode")
            self.prefill_runner = graphs.get("prefill")
        else:
            self.cache = model.new_cache(batch_size)
        self.kind = draft.features if draft is not None else FeatureKind.none  # target features it reads
        self.mode = CaptureHiddenMode.FULL if self.kind != FeatureKind.none else CaptureHiddenMode.NULL

    @property
    def stats(self) -> RoundStats:
        """Rounds so far and their draft / verify time (waits for the last round's draft extend)."""
        seconds = self.clock.totals()
        return RoundStats(self.rounds, seconds.get("draft", 0.0), seconds.get("verify", 0.0))

    def reset_stats(self) -> None:
        self.rounds = 0
        self.clock.reset()

    def _forward(self, runner, live: dict, kv_len: int, cache) -> ForwardOutput:
        """Through the phase's graph runner when there is one (it falls back by itself), else eager."""
        if runner is None:
            return self.model(live["tokens"], live["positions"], cache, valid=live["valid"], kv_len=kv_len,
                              input_embeds=live.get("input_embeds"), logits_index=live.get("logits_index"))
        out, _ = runner(live, kv_len, self.mode)
        return ForwardOutput(out["logits"], out.get("hidden"), out.get("aux"), out.get("embeds"))

    def prefill(self, prompts: list[list[int]], prompt_embeds, cache, use_graph: bool = True) -> Prefill:
        """The target's prefill of `prompts` into `cache` (rows 0..b-1 of it: pass a row view to
        prefill other rows). use_graph=False: eagerly (the prefill graph covers rows 0..b-1 only)."""
        b, dev = len(prompts), self.device
        lens = [len(p) for p in prompts]
        width = max(lens)
        tokens = torch.zeros(b, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        tokens = tokens.to(dev)
        positions = torch.arange(width, device=dev).expand(b, width)  # [b, width]
        valid = positions < torch.tensor(lens, device=dev)[:, None]
        runner = self.prefill_runner if use_graph else None
        given = prompt_embeds is not None and any(e is not None for e in prompt_embeds)
        embeds = None
        if given or runner is not None:  # the piecewise prefill graph takes embeddings
            embeds = self.model.model.embed_tokens(tokens)  # [b, width, hidden]
            for i, e in enumerate(prompt_embeds or []):
                if e is not None:
                    embeds[i, : e.shape[0]] = e.to(embeds.dtype)
        live = {"tokens": tokens, "positions": positions, "valid": valid, "input_embeds": embeds,
                "logits_index": torch.tensor(lens, device=dev) - 1}
        out = self._forward(runner, live, width, cache)
        return Prefill(out, tokens, valid, embeds if given else None)

    def begin(self, state: SpecState, pre: Prefill, first: Tensor, rows: Optional[slice] = None) -> None:
        """The draft's prefill after the target's (rows: where in the batch these prompts sit)."""
        if self.draft is not None:
            self.draft.begin(state, _features(pre.out, self.kind), pre.tokens, pre.valid, pre.embeds, first,
                             rows=rows)

    def round(self, state: SpecState, last: Tensor, sampling: SamplingParams | RowSampling,
              cache, generator: Optional[torch.Generator] = None) -> RoundResult:
        """One round over every row of `state`: propose k, verify k + 1, draft extend, advance the live
        rows' history and lengths. last [b]: each row's last emitted token (not yet in the cache)."""
        b, k, draft, dev, clock = len(state.lengths), self.k, self.draft, self.device, self.clock
        sampling = as_rows(sampling, generator)
        t_round = clock.mark()
        if draft is not None:
            proposal = draft.propose(state, k)
            draft_tokens, q = proposal.tokens, proposal.probs  # [b, k], [b, k, vocab] | None
        else:
            draft_tokens, q = last.new_empty(b, 0), None
        t_verify = clock.mark()
        lengths, live = state.on_device()  # [b], [b]
        tokens = torch.cat([last[:, None], draft_tokens], 1) if k else last[:, None]  # [b, k+1]
        steps = torch.arange(k + 1, device=dev)
        out = self._forward(self.round_runner, {"tokens": tokens, "positions": lengths[:, None] + steps,
                                                "valid": live[:, None].expand(b, k + 1)},
                            max(state.lengths) + k + 1, cache)
        accepted, bonus = verify(out.logits, draft_tokens, q, sampling)  # [b], [b]
        if k:
            emitted = torch.cat([draft_tokens, bonus[:, None]], 1)  # [b, k+1]
            emitted[torch.arange(b, device=dev), accepted] = bonus
        else:
            emitted = bonus[:, None]
        t_done = clock.mark()
        host = torch.cat([accepted[:, None], emitted], 1).tolist()  # the round's one sync
        now = time.perf_counter()
        self.rounds += 1
        clock.span("draft", t_round, t_verify)
        clock.span("verify", t_verify, t_done)
        clock.settle()  # this round's spans and the previous round's draft extend: all before the sync

        if draft is not None and k > 0:  # the draft extend runs while the host advances the rows
            t_commit = clock.mark()
            draft.commit(state, _features(out, self.kind), emitted, accepted)  # before the state advances
            clock.span("draft", t_commit, clock.mark())
        acc, new = [0] * b, [[] for _ in range(b)]
        for i, row in enumerate(host):
            if state.live[i]:
                acc[i], new[i] = row[0], row[1: row[0] + 2]
                state.history[i] += new[i]
                state.lengths[i] += len(new[i])
        return RoundResult(acc, new, bonus, now)


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
    ) -> list[SequenceResult]:
        b, k, dev = len(prompts), self.k, self.device
        if not 0 < b <= self.batch_size:
            raise ValueError(f"batch of {b} prompts; this generator holds 1..{self.batch_size}")
        lens = [len(p) for p in prompts]
        if min(lens) == 0:
            raise ValueError("empty prompt")
        check_capacity(lens, params.max_new_tokens, self.model.max_seq_len, k)
        cache = self.cache.rows(b)
        stop = frozenset() if params.ignore_eos else stop_ids
        sampling = RowSampling.uniform(params, generator)
        state = SpecState([list(p) for p in prompts], list(lens), [True] * b,
                          row_ids if row_ids is not None else list(range(b)), dev)

        t0 = time.perf_counter()
        pre = self.prefill(prompts, prompt_embeds, cache)
        last = sample(pre.out.logits[:, -1], sampling)  # [b]
        self.begin(state, pre, last)
        if k == 0 and sync_every > 1:
            return self._decode_on_device(lens, last, sampling, cache, params.max_new_tokens, stop, sync_every, t0)

        outs: list[list[int]] = [[] for _ in range(b)]
        accepts: list[list[int]] = [[] for _ in range(b)]
        first_t, last_t = [0.0] * b, [0.0] * b

        def emit(new: list[list[int]], now: float) -> None:
            for i, toks in enumerate(new):
                if not state.live[i]:
                    continue
                for tok in toks:
                    outs[i].append(tok)
                    if tok in stop or len(outs[i]) >= params.max_new_tokens:
                        state.live[i] = False
                        break
                first_t[i] = first_t[i] or now
                last_t[i] = now

        first = last.tolist()
        emit([[t] for t in first], time.perf_counter())
        for i, t in enumerate(first):
            state.history[i].append(t)
        while any(state.live):
            was_live = list(state.live)
            r = self.round(state, last, sampling, cache)
            emit(r.emitted, r.time)
            for i in range(b):
                if was_live[i]:
                    accepts[i].append(r.accepted[i])
            last = r.bonus

        return [
            SequenceResult(
                tokens=outs[i], prompt_len=lens[i], ttft_s=first_t[i] - t0, decode_s=last_t[i] - first_t[i],
                finish_reason="stop" if outs[i][-1] in stop else "length", accepts=accepts[i],
            )
            for i in range(b)
        ]

    def _decode_on_device(self, lens: list[int], last: Tensor, sampling: RowSampling, cache, max_new: int,
                          stop: frozenset[int], sync_every: int, t0: float) -> list[SequenceResult]:
        """Plain decoding with the bookkeeping on the device, for large batches (self-distillation).

        The round loop copies every step's tokens to the host and walks the rows in Python (about 2 ms a
        step at 1024 rows on a CI core, with the device idle meanwhile). Here the step's token, the stop
        test and the lengths stay on the device; the host looks every `sync_every` steps, only to see
        whether every row is done, and the tokens come back once. Each step is the round loop's forward
        and sampling call, so the tokens are the same; a row's finish time is known to within
        `sync_every` steps.

        last [b]: the prefill's token. Buffers: out [b, max_new + 1] (column max_new takes the writes
        of finished rows), count / lengths [b] (tokens emitted / tokens in the cache), live [b] bool.
        """
        b, dev = len(lens), self.device
        rows = torch.arange(b, device=dev)
        out = torch.zeros(b, max_new + 1, dtype=torch.long, device=dev)  # [b, max_new + 1]
        out[:, 0] = last
        count = torch.ones(b, dtype=torch.long, device=dev)  # [b]
        lengths = torch.tensor(lens, device=dev)  # [b]: the last emitted token is not in the cache yet
        stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=dev)
        live = ~torch.isin(last, stop_ids) & (count < max_new)  # [b]
        no_draft = last.new_empty(b, 0)
        live_host = live.tolist()
        first_t = time.perf_counter()
        done_t = [first_t] * b
        step, longest = 0, max(lens)  # steps run (every row is done after max_new - 1); the kv bound
        while any(live_host) and step < max_new - 1:
            t_step = self.clock.mark()
            for _ in range(min(sync_every, max_new - 1 - step)):
                fwd = self._forward(self.round_runner, {"tokens": last[:, None], "positions": lengths[:, None],
                                                        "valid": live[:, None]}, longest + step + 1, cache)
                _, bonus = verify(fwd.logits, no_draft, None, sampling)  # [b]
                out[rows, torch.where(live, count, max_new)] = bonus
                count, lengths = count + live, lengths + live
                last = torch.where(live, bonus, last)
                live = live & ~torch.isin(bonus, stop_ids) & (count < max_new)
                step += 1
            t_end = self.clock.mark()
            now_live = live.tolist()
            now = time.perf_counter()
            self.clock.span("verify", t_step, t_end)
            self.clock.settle()
            for i, (was, is_) in enumerate(zip(live_host, now_live)):
                if was and not is_:
                    done_t[i] = now
            live_host = now_live
        self.rounds += step
        tokens = [row[:n] for row, n in zip(out.tolist(), count.tolist())]
        return [SequenceResult(tokens=t, prompt_len=n, ttft_s=first_t - t0, decode_s=done - first_t,
                               finish_reason="stop" if t[-1] in stop else "length", accepts=[0] * (len(t) - 1))
                for t, n, done in zip(tokens, lens, done_t)]
