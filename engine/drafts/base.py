"""The draft interface every algorithm implements, and the round state it shares with the round.

A round (engine/speculative/round.py), per row with L tokens in the target cache and x_L not yet in it: propose
d_1..d_k, the target verifies [x_L, d_1..d_k] at L..L+k, a of them are accepted, the draft extends
over the a + 1 verified positions. Host drafts (n-gram, oracle) return tokens from `propose(state, k)`;
device drafts (`DeviceDraft`: EAGLE3, EAGLE, multi-layer EAGLE, DFlash) run inside the captured round:
`propose_into(s, ...)` and `extend(s, ...)` over a `RoundState` s (their own state in `s.own` and
`s.q`, buffers of `batch_size` rows that a graph replays over). A sampled row draws each proposal from
the draft's q (kept in s.q [b, K, Vd]) at position P with (seed, P, DRAFT): d_i at L + i, the next d_1
at L + a + 2. `begin` is the draft's prefill; `rows=slice(i, j)` fills only those rows (continuous
batching). Each algorithm's folder exports an `Algorithm` record; the registry is their table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, runtime_checkable

import torch
from torch import Tensor

from engine import aux_layers
from engine.drafts.config import DraftKeys
from engine.graphs.runner import InputSpec, allocate
from engine.ops import Live
from engine.sampling import Draws

if TYPE_CHECKING:
    from engine.drafts.checkpoint import HeadCheckpoint
    from engine.model import LlamaModel, ModelArgs


class FeatureKind(str, enum.Enum):
    none = "none"
    final = "final"  # target's final normed hidden states [b, t, hidden]
    aux = "aux"  # target's aux hidden states, concatenated [b, t, hidden * n_aux]


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
class RoundState:
    """The round's device state over b rows (views of the state buffers; see the module docstring)."""

    last: Tensor
    lengths: Tensor
    live: Tensor
    draft: Tensor
    out: Tensor
    temperature: Tensor
    top_p: Tensor
    seed: Tensor
    speculate: Tensor
    q: Optional[Tensor] = None
    own: dict = field(default_factory=dict)
    state: Live = field(default_factory=Live)  # the host's SpecState (None at capture): what a host hook reads

    @classmethod
    def of(cls, buffers: dict) -> "RoundState":
        """From the state buffers by name (round_buffers: the round's, d_q, the draft's own d_*) and the
        host's `state` (a value, or a graph runner's Live box)."""
        mine = {f.name: buffers[f.name] for f in fields(cls) if f.name not in ("q", "own", "state")}
        own = {n: t for n, t in buffers.items() if n.startswith("d_") and n != "d_q"}
        return cls(**mine, q=buffers.get("d_q"), own=own, state=Live.of(buffers.get("state")))

    def draws(self) -> Draws:
        return Draws(self.temperature, self.top_p, self.seed)


@dataclass
class Verified:
    """What the verify hands the extend: emitted [b, k+1] (d_1..d_a, then the bonus at index a; the rest
    garbage), accepted [b] (a), bonus [b], and the target's features at the k + 1 positions."""

    emitted: Tensor
    accepted: Tensor
    bonus: Tensor
    feats: Optional[Tensor]


@dataclass
class Proposal:
    tokens: Tensor  # [b, k] int64, target vocabulary
    probs: Optional[Tensor] = None  # [b, k, vocab] draft distribution; None: deterministic (one-hot)


class Draft:
    """Base class: host drafts override `propose` only."""

    features: FeatureKind = FeatureKind.none
    on_device = False  # its proposal and extend run inside the round (DeviceDraft)

    def begin(
        self,
        state: SpecState,
        feats: Optional[Tensor],
        prompt_tokens: Tensor,
        valid: Tensor,
        input_embeds: Optional[Tensor],
        first: Tensor,
        rows: Optional[slice] = None,
        draws: Optional["Draws"] = None,
    ) -> None:
        """Draft prefill. prompt_tokens/valid [n, T]; feats [n, T, F]; input_embeds [n, T, H] (the
        target's, reused for prompt positions); first [n]: the target's first emitted token.
        rows: the batch rows these n prompts occupy (None: they are the whole batch). draws: the rows'
        sampling when some of them sample (their first proposal is drawn, its q kept), else None."""

    def propose(self, state: SpecState, k: int) -> Proposal:
        raise NotImplementedError


class DeviceDraft(Draft):
    """A draft whose round work runs on the device over state buffers of `batch_size` rows.

    Subclasses set `head` and define `own_specs`, `propose_into`, `extend` and `begin`.
    `offsets` (d2t) and `vocab_map` (a target id's draft id, -1 outside) are set for heads with a draft
    vocabulary of their own (EAGLE3), None for heads over the target's.
    """

    on_device = True
    draws_at_prefill = True  # a sampled prefill draws d_1 (its q: d_q's first column)
    temperature_factor = 1.0  # DraftPlan.temperature_factor: the head's q at the request's temperature x this
    head: torch.nn.Module
    batch_size: int

    def __init__(self, head, batch_size: int, k: int):
        self.head, self.batch_size, self.k = head, batch_size, k
        if head.target_ref and head.target_ref[0].fused and not head.fused:
            head.use_fused_kernels()  # the target's fused kernels for the draft's layers too
        self.cache = head.new_cache(batch_size)
        device = next(head.parameters()).device
        self.offsets = self.vocab_map = None
        if not head.shares_lm_head:  # a draft vocabulary: target id = draft id + d2t[draft id]
            self.offsets = head.d2t
            ids = torch.arange(head.d2t.shape[0], device=device)
            self.vocab_map = torch.full((head.args.vocab_size,), -1, dtype=torch.int32, device=device)
            self.vocab_map[ids + head.d2t] = ids.to(torch.int32)
        self.buf: dict[str, Tensor] = allocate(self.state_specs(k), batch_size, device)

    @property
    def attention_kernel(self) -> bool:
        return self.head.attention_kernel

    def q_draws(self, draws: Draws) -> Draws:
        """The draws of the head's proposals: the rows' temperatures x temperature_factor (greedy rows stay
        greedy). Any q keeps the round lossless, since the verify accepts against the q drawn from; a head
        less sure than the target drafts better below 1, one surer than it above. A prefill computes them;
        rounds read them from d_temperature, written when the rows start (keep_temperatures)."""
        if self.temperature_factor == 1.0:
            return draws
        return Draws(draws.temperature * self.temperature_factor, draws.top_p, draws.seed)

    def keep_temperatures(self, temperature: Tensor, rows: slice) -> None:
        """Starting rows' temperatures [n] -> their q_draws temperatures in d_temperature (once a row, so
        that a captured round spends no kernel on the factor)."""
        if self.temperature_factor != 1.0:
            self.buf["d_temperature"][rows] = temperature * self.temperature_factor

    def round_draws(self, s: RoundState) -> Draws:
        """A round's draws of the head's proposals: q_draws of the rows' settings (d_temperature)."""
        if self.temperature_factor == 1.0:
            return s.draws()
        return Draws(s.own["d_temperature"], s.top_p, s.seed)

    def graph_meta(self) -> dict:
        return self.head.graph_meta()

    def state_specs(self, k: int) -> dict:
        """name -> engine.graphs.runner.InputSpec (per row, state) of the draft's buffers: its own, and
        d_q [K, Vd] fp32 (a sampled round's proposal distributions, read by the verify's accept) and
        d_temperature [] fp32 (keep_temperatures)."""
        vocab = self.head.lm_head.weight.shape[0]
        return {
            **self.own_specs(k),
            "d_q": InputSpec((k, vocab), torch.float32, None, per_row=True, state=True),
            "d_temperature": InputSpec((), torch.float32, 0.0, per_row=True, state=True),  # q_draws' temperatures
        }

    def own_specs(self, k: int) -> dict:
        """The algorithm's own state buffers (name -> InputSpec)."""
        return {}

    def propose_into(self, s: RoundState, cache, k: int, kv_len, sampled: bool = False) -> Optional[Tensor]:
        """The round's proposal (phase draft): d_1..d_k into s.draft[:, :k] (sampled: their q into s.q);
        -> the logits of its last forward, if it formed any (for a host hook to read)."""
        raise NotImplementedError

    def extend(self, s: RoundState, cache, v: Verified, kv_len, sampled: bool = False) -> None:
        """The round's draft extend (phase extend): catch up on the verified positions L..L+a."""
        raise NotImplementedError

    # -- the prefill: eagerly into the rows (`begin`), or as a program a graph runner replays ----------
    def prefill(self, cache, feats, tokens, valid, embeds, first, draws=None, q=None, kv_len=None) -> dict[str, Tensor]:
        """`begin`'s work over `cache` (the n rows' view) -> the rows of its own state buffers (name ->
        [n, ...]); with draws, d_1's q goes into q [n, 1, Vd]. kv_len: the attention's (an int or a
        graph's `Live`, whose replays rebuild the mask; None: the prompts' width). Else as in `begin`."""
        raise NotImplementedError

    def begin(self, state, feats, prompt_tokens, valid, input_embeds, first, rows=None, draws=None) -> None:
        n = first.shape[0]
        sl = rows if rows is not None else slice(0, n)
        q = self.buf["d_q"][sl, :1] if draws is not None else None
        draws = self.q_draws(draws) if draws is not None else None
        out = self.prefill(self.cache.rows(sl), feats, prompt_tokens, valid, input_embeds, first, draws, q)
        self.settle(out, rows)

    def settle(self, out: dict[str, Tensor], rows: Optional[slice]) -> None:
        """A prefill's state rows into the buffers' `rows` (d_q: d_1's, its first column)."""
        for name, x in out.items():
            write_rows(self.buf[name][:, :1] if name == "d_q" else self.buf[name], x, rows)

    def prefill_specs(self) -> dict[str, InputSpec]:
        """The prefill program's inputs besides the token inputs (tokens, positions, valid)."""
        return {
            "feats": InputSpec((self.head.feature_width,), next(self.head.parameters()).dtype, 0),
            "first": InputSpec((), torch.long, 0, per_row=True),
            "temperature": InputSpec((), torch.float32, 0.0, per_row=True),  # 0: a padding row draws greedily
            "top_p": InputSpec((), torch.float32, 1.0, per_row=True),
            "seed": InputSpec((), torch.long, 0, per_row=True),
        }

    def prefill_program(self, cache, sampled: bool) -> list:
        """The prefill as one step over an env (engine/graphs/program.py) into `cache` (the program's rows).

        env in:  tokens, positions, valid [b, t], feats [b, t, F], first [b]; sampled: temperature, top_p,
                 seed [b]
        env out: the state rows `prefill` returns ([b, ...]); sampled: d_q [b, 1, Vd]."""
        from engine.graphs.program import Step

        vocab = self.head.lm_head.weight.shape[0]

        def run(env: dict) -> None:
            b = env["first"].shape[0]
            draws = q = None
            if sampled:
                draws = self.q_draws(Draws(env["temperature"], env["top_p"], env["seed"]))
                q = torch.empty(b, 1, vocab, dtype=torch.float32, device=env["first"].device)
            feats, tokens, valid, first = env["feats"], env["tokens"], env["valid"], env["first"]
            out = self.prefill(cache, feats, tokens, valid, None, first, draws, q, env["kv_len"])
            env.update(out, **({"d_q": q} if sampled else {}))

        return [Step("draft_prefill", run, meta=self.graph_meta())]

    # -- alone, eagerly (tests, tools): the round's work over a state built from the host's -----------
    def _state(self, state: SpecState, k: int) -> RoundState:
        b = len(state.lengths)
        lengths, live = state.on_device()
        last = torch.tensor([h[-1] for h in state.history], device=lengths.device)
        zeros = torch.zeros(b, device=lengths.device)  # greedy: no row samples
        draft = torch.zeros(b, k, dtype=torch.long, device=lengths.device)
        own = {name: t[:b] for name, t in self.buf.items() if name != "d_q"}
        q = self.buf["d_q"][:b]
        return RoundState(last, lengths, live, draft, None, zeros, zeros, zeros.long(), live, q, own)  # no host state

    def propose(self, state: SpecState, k: int) -> Proposal:
        s = self._state(state, k)
        self.propose_into(s, self.cache.rows(len(state.lengths)), k, max(state.lengths))
        return Proposal(s.draft)

    def commit(self, state: SpecState, feats: Optional[Tensor], emitted: Tensor, accepted: Tensor) -> None:
        """Draft extend, before `state` advances (state.lengths[r] = L, the verify's first position).
        emitted [b, k+1]: d_1..d_a then the bonus at index a (the rest is garbage); accepted [b] = a;
        feats [b, k+1, F] at positions L..L+k."""
        s = self._state(state, emitted.shape[1] - 1)
        v = Verified(emitted, accepted, emitted.gather(1, accepted[:, None])[:, 0], feats)
        self.extend(s, self.cache.rows(len(state.lengths)), v, max(state.lengths))


def write_rows(buf: Tensor, value: Tensor, rows: Optional[slice]) -> None:
    """A draft state buffer's rows after a prefill: `rows`, or the first n (a fresh batch of n rows)."""
    buf[rows if rows is not None else slice(0, value.shape[0])] = value


# ---------------------------------------------------------------------------------------- heads
@runtime_checkable
class DraftHead(Protocol):
    """The weights of a device draft (engine/drafts/common/head.py's `HeadBase` implements the shared part).

    What every head offers the registry, the graphs and the train stage. Its forwards are the contract
    with its own draft loop: `FeatureHead` below for the EAGLE-family loop; the multi-layer head's
    `module_forward` and DFlash's block `forward` / `write_context` are documented in their folders.

    Tensors: b rows, t positions, H the head's hidden size, F the target features it reads
    (`feature_width`: n_aux x target hidden for aux features, the target's hidden size for final ones).
    """

    architecture: str  # config.json's architectures[0]; a checkpoint of another one is refused
    config: dict  # the config.json it was built from (and saves)
    max_seq_len: int  # the target's: its cache and RoPE tables cover these positions

    def __init__(self, cfg: dict, max_seq_len: int) -> None: ...

    @property
    def feature_width(self) -> int:
        """F: the width of the target features the draft's prefill and extend read."""
        ...

    def bind(self, target: "LlamaModel") -> "DraftHead":
        """Share the target's token embedding and lm_head (same storage, out of state_dict); returns self."""
        ...

    def init_buffers(self, device=None) -> None:
        """RoPE tables [cache_slots + 1, head_dim] on `device` (non-persistent buffers)."""
        ...

    def new_cache(self, batch_size: int):
        """The head's own static KV cache of `batch_size` rows (multi-layer: one pool per module)."""
        ...

    def use_fused_kernels(self) -> None:
        """Switch to the fused Triton path (in place; inference heads only)."""
        ...

    def graph_meta(self) -> dict:
        """The target storage a captured draft graph reads: {embed_ptr, lm_head_ptr} (hazard 7)."""
        ...

    def copy(self, device=None, dtype: Optional[torch.dtype] = None) -> "DraftHead":
        """Same type, config and weights in storage of its own, bound to the same target."""
        ...

    def save(self, path) -> None:
        """config.json + model.safetensors in the public layout of `architecture`."""
        ...


@runtime_checkable
class FeatureHead(DraftHead, Protocol):
    """A one-step head that the EAGLE-family loop (engine/drafts/common/feature.py) chains: EAGLE3, EAGLE."""

    def attn_inputs(self, positions: Tensor, valid: Optional[Tensor], kv_len, dtype=None, **kw):
        """positions [b, t], valid [b, t] or None, kv_len (int or engine.ops.Live) -> the call's AttnInputs."""
        ...

    def forward(self, hidden: Tensor, cache, a, tokens=None, embeds=None, sampled: bool = False):
        """hidden [b, t, F or H], tokens [b, t] (or embeds [b, t, H]) -> DraftOut: out_hidden [b, t, H],
        ids [b, t] (greedy, target ids; not with `sampled` on the fused path), logits [b, t, V]
        (`sampled`, or the unfused path)."""
        ...

    def logits(self, h: Tensor) -> Tensor:
        """out_hidden [..., H] -> the draft's logits [..., V]."""
        ...


# ---------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class DraftPlan:
    """What the plan resolved for a draft from config files alone (no weights)."""

    algorithm: str  # the registry name
    features: FeatureKind
    aux: Optional[aux_layers.AuxLayers] = None  # drafts reading aux features: the target layers to capture
    head_config: Optional[dict] = None  # weighted drafts: the head's config.json
    checkpoint: Optional["HeadCheckpoint"] = None
    temperature_factor: float = 1.0  # sampled rounds: the head's q at the request's temperature x this
    # The algorithm's record; registry.plan_draft sets it (a folder's plan function cannot name its own
    # record, which is built from it).
    spec: Optional["Algorithm"] = field(default=None, repr=False, compare=False)

    @property
    def random_weights(self) -> bool:
        """A draft with weights (EAGLE family, multi-layer, DFlash) and no checkpoint: random init."""
        return self.checkpoint is None and self.head_config is not None

    def random_weights_warning(self) -> str:
        return (
            f"the {self.algorithm} head has RANDOM WEIGHTS (draft.init=random): its accept_length and speedup "
            f"measure plumbing and timing, not the algorithm. Train one with `python -m pipeline "
            f"{self.spec.recipe}`, or point draft.path at a trained checkpoint with draft.init=checkpoint"
        )

    def describe(self) -> str:
        parts = [self.algorithm]
        if self.checkpoint is not None:
            parts.append(f"checkpoint {self.checkpoint.path}")
        elif self.head_config is not None:
            parts.append("RANDOM-WEIGHT head")
        parts += (self.spec.describe if self.spec is not None else vocab_details)(self)
        if self.aux is not None:
            parts.append(f"aux layers {self.aux.describe()}")
        if self.temperature_factor != 1.0:
            parts.append(f"sampled proposals at T x {self.temperature_factor:g}")
        return ", ".join(parts)


@dataclass(frozen=True)
class DraftContext:
    """What `Algorithm.make` may use to build a run's Draft object."""

    target: "LlamaModel"
    batch_size: int
    k: int  # draft tokens per round (draft.num_steps)
    cfg: Any = None  # the algorithm's own config (Algorithm.config)
    references: Optional[list[list[int]]] = None  # the baseline's outputs (oracle)
    prompt_lens: Optional[list[int]] = None


def vocab_details(plan: DraftPlan) -> list[str]:
    """The plan line's words for a head with a draft vocabulary of its own ([] without one)."""
    cfg = plan.head_config or {}
    return [f"draft vocab {cfg['draft_vocab_size']}"] if "draft_vocab_size" in cfg else []


@dataclass(frozen=True)
class Algorithm:
    """One draft algorithm, as its folder exports it.

    config    the dataclass of the `draft.*` keys it reads (engine/drafts/config.py); plan and make get it
    plan      (cfg: its config, target: ModelArgs) -> DraftPlan; raises ConfigError naming the key
    make      (plan, head or None, DraftContext) -> Draft, per run (its own KV cache and state buffers)
    head      the `DraftHead` class built from DraftPlan.head_config (None: weightless)
    train     how it trains on the shared self-distilled data (None: not trainable)
    recipe    the shipped experiment that trains its head (for the random-weights warning)
    describe  (plan) -> the plan line's words particular to it
    """

    name: str
    config: type[DraftKeys]
    plan: Callable[[Any, "ModelArgs"], DraftPlan]
    make: Callable[[DraftPlan, Optional[torch.nn.Module], DraftContext], Draft]
    head: Optional[type] = None
    train: Any = None  # engine.drafts.train_contract.TrainSpec (typed there: it reads FeatureKind from here)
    recipe: Optional[str] = None
    describe: Callable[[DraftPlan], list[str]] = vocab_details
    needs_baseline: bool = False  # proposes the no-draft baseline's outputs (the oracle)
