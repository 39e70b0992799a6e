"""One builder for every decoder forward: a stack of layers as program steps (target and draft heads).

Design
------
A decoder forward is the same chain wherever it runs (the target, EAGLE3 / EAGLE's single layer, each
multi-layer EAGLE module, DFlash's block): the layer's work before attention (norm, q/k/v, RoPE, cache
write), the attention over the cache, the work after it (o_proj, MLP). `decoder_steps` turns a stack
into `engine.program.Step`s with the attention of every layer a break:

    segment  start (the stream, the AttnInputs) + pre(0)              name: names.first
    break    attention of layer i (mask built once, by layer 0)      name: names.attn
    segment  post(i) + pre(i + 1), or post(last) + finish            name: names.post / names.last

The per-layer math stays in `DecoderLayer.pre/post` and `Attention.attend` (engine/model.py). What
differs between callers is passed in typed form: `start` (how the stream begins: embed tokens, given
embeds, a head's input fusion), `AttnSource` (how AttnInputs are built; DFlash's non-causal block, the
kv length the mask covers), `capture` (layers whose entering stream is kept: aux hidden states) and
`finish` (norm + lm_head, argmax, slicing). A layer is anything with `pre(env)`, `post(env)` and
`attention` (the `Layer` protocol): `Residual` adapts a `DecoderLayer` over the (x, delta) stream;
the EAGLE heads pass an `EnvLayer` of their own `pre` / `post`, whose q/k/v read a fused
[embeds, hidden] input that no plain layer has.

Env keys this module owns (b rows, t positions, h hidden, d head_dim):

    in   positions [b, t], valid [b, t] bool or None, kv_len (host int), causal (host bool, optional:
         `causal=True` builds only)
    x      [b, t, h]          the residual stream (x + delta is its value)
    delta  [b, t, h] or None  the last sublayer's output, added by the next norm (fused: in its kernel)
    attn   AttnInputs         slots, RoPE rows, query bounds of this call
    q      [b, heads, t, d]   a layer's queries (pre -> attention)
    o      [b, t, heads * d]  its attention output (attention -> post)
    mask   [b, 1, t, kv] bool or None (None: the Triton kernel or SDPA's causal kernel)
    aux_list  list of [b, t, h]: the streams entering the `capture` layers, in layer order

Graph backends (engine/graphs/backends.py, engine/program.py) capture the segments and run the breaks
eagerly; a break's inputs and outputs are tracked by env key, so these keys hold the same tensors with
the same meaning in every program: a break reads q, attn, mask (and kv_len) and writes o (and, at
layer 0, mask, whose shape follows the live kv_len). `attn` is made in the first segment; `aux_list`
is appended to by segments only, never by a break. Python cost per eager step: one closure per step
plus the layer's calls, no dict or list built per call beyond the env's own entries.

`AttnInputs` (the per-call attention metadata every layer reads) lives here; engine/model.py builds on
this module, so its StaticKVCache, Attention and DecoderLayer appear below as the protocols they meet.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch
from torch import Tensor

from engine.program import Step
from kernels.decode_attention import slot_mask
from kernels.fused import rope_cache_write

STREAM, DELTA, QUERY, ATTN_OUT = "x", "delta", "q", "o"  # the residual stream, a layer's queries and attention output
MASK, ATTN, AUX_LIST = "mask", "attn", "aux_list"
CAUSAL = "causal"  # set by the first step of LlamaModel.program(causal=True): SDPA's causal kernel over fresh rows

EnvFn = Callable[[dict], None]


class KVCache(Protocol):
    """A static KV cache (engine/model.py's StaticKVCache): [layers, b, kv_heads, slots + 1, d] each."""

    k: Tensor
    v: Tensor
    dummy_slot: int


class Attention(Protocol):
    """engine/model.py's Attention: the break's work, q [b, heads, t, d] -> o [b, t, heads * d]."""

    def attend(
        self,
        q: Tensor,
        cache: KVCache,
        mask: Optional[Tensor],
        a: AttnInputs,
        causal: bool = False,
        max_rows: Optional[int] = None,
    ) -> Tensor: ...


class DecoderLayer(Protocol):
    """engine/model.py's DecoderLayer: the math on each side of the attention, over (x, delta)."""

    self_attn: Attention

    def pre(
        self, x: Tensor, delta: Optional[Tensor], cache: KVCache, a: AttnInputs, fused: bool, max_rows: Optional[int]
    ) -> tuple[Tensor, Tensor]: ...

    def post(self, h: Tensor, o: Tensor, fused: bool, max_rows: Optional[int]) -> tuple[Tensor, Tensor]: ...


@dataclass
class AttnInputs:
    """Per-call attention metadata shared by every layer: RoPE positions, cache slots, query bounds.

    Two kernels build it (the slots and the positions of valid tokens); the fused RoPE kernel reads the
    fp32 tables at `rope_pos` itself, and only the plain path gathers cos / sin rows (`cos`, `sin`,
    on first use). The mask depends on `kv_len`, which a graph with eager attention breaks (breakable,
    piecewise) chooses per replay; it is built by the first attention call (`mask(kv_len)`).
    """

    slots: Tensor  # [b, t] cache slot each token writes (padding -> the dummy slot)
    rope_pos: Tensor  # [b, t] each token's position (padding -> 0): its RoPE row
    qpos: Tensor  # [b, t] position each query attends up to (padding -> 0; DFlash: the block's last)
    max_kv: int  # the cache's slots (the dummy slot excluded)
    rope_cos: Tensor  # [max_pos, head_dim] float32 tables
    rope_sin: Tensor
    dtype: torch.dtype  # the activations'
    qlo: Optional[Tensor] = None  # [b, t] first slot each query attends (a sliding window); None: slot 0

    @classmethod
    def build(
        cls,
        positions: Tensor,
        valid: Optional[Tensor],
        rope_cos: Tensor,
        rope_sin: Tensor,
        dummy_slot: int,
        dtype: torch.dtype,
    ) -> "AttnInputs":
        if valid is not None:
            slots = torch.where(valid, positions, dummy_slot)
            positions = torch.where(valid, positions, 0)
        else:
            slots = positions
        return cls(slots, positions, positions, dummy_slot, rope_cos, rope_sin, dtype)

    @functools.cached_property
    def cos(self) -> Tensor:
        """[b, 1, t, head_dim] in the activations' dtype (the plain path's apply_rope)."""
        return self.rope_cos[self.rope_pos].to(self.dtype)[:, None]

    @functools.cached_property
    def sin(self) -> Tensor:
        return self.rope_sin[self.rope_pos].to(self.dtype)[:, None]

    def mask(self, kv_len: int) -> Tensor:
        """[b, 1, t, kv_len] bool: a query at position p sees slots 0..p (never the dummy slot), from
        qlo on when windowed."""
        return slot_mask(self.qpos, self.qlo, min(kv_len, self.max_kv))

    def rope_write(self, qkv: Tensor, cache: KVCache, layer: int, heads: int, kv_heads: int) -> Tensor:
        """The fused path: qkv [b, t, (heads + 2 kv) * d] -> q [b, heads, t, d]; k (RoPE'd), v at the slots."""
        return rope_cache_write(
            qkv,
            self.rope_cos,
            self.rope_sin,
            self.rope_pos,
            self.slots,
            cache.k[layer],
            cache.v[layer],
            heads,
            kv_heads,
        )


class Layer(Protocol):
    """One layer as the builder drives it: `pre` reads the stream and writes env q (and this call's
    k/v into the cache), `post` reads env o and writes the stream; `attention` runs between them."""

    attention: Attention

    def pre(self, env: dict) -> None: ...

    def post(self, env: dict) -> None: ...


@dataclass(frozen=True)
class Residual:
    """A `DecoderLayer` over the (x, delta) stream in env. `max_rows`: _rows_kernel's row limit."""

    layer: DecoderLayer
    cache: KVCache
    fused: bool = False
    max_rows: Optional[int] = None

    @property
    def attention(self) -> Attention:
        return self.layer.self_attn

    def pre(self, env: dict) -> None:
        env[STREAM], env[QUERY] = self.layer.pre(
            env[STREAM], env[DELTA], self.cache, env[ATTN], self.fused, self.max_rows
        )

    def post(self, env: dict) -> None:
        env[STREAM], env[DELTA] = self.layer.post(env[STREAM], env[ATTN_OUT], self.fused, self.max_rows)


@dataclass(frozen=True)
class EnvLayer:
    """A layer given as env functions (an EAGLE head's single layer: its own input fusion and output)."""

    attention: Attention
    pre: EnvFn
    post: EnvFn


@dataclass(frozen=True)
class AttnSource:
    """How a program builds its AttnInputs from env positions / valid.

    rope: the module holding the float32 `rope_cos` / `rope_sin` tables (read per call: a re-init
    after building the program is seen). dtype: the activations' (None: the stream's, built after
    `start`; given: built before it). block: non-causal inside the block (DFlash): every query of a
    row sees up to the row's last slot (padding rows: 0), RoPE still at its own position.
    kv_extra: slots the mask covers past env kv_len (DFlash: the block, see DFlashHead.block_program).
    window: a query at position p sees slots p - window + 1.. only (0: no window), as a Hugging Face
    `sliding_attention` layer does.
    """

    rope: torch.nn.Module
    dummy_slot: int
    dtype: Optional[torch.dtype] = None
    block: bool = False
    kv_extra: int = 0
    window: int = 0

    def build(self, env: dict, dtype: torch.dtype) -> AttnInputs:
        r = self.rope
        a = AttnInputs.build(env["positions"], env["valid"], r.rope_cos, r.rope_sin, self.dummy_slot, dtype)
        if self.window:
            a = dataclasses.replace(a, qlo=(a.rope_pos - (self.window - 1)).clamp(min=0))  # [b, t]; padding: 0
        if not self.block:
            return a
        last = a.qpos.amax(1, keepdim=True).expand_as(a.qpos)  # [b, t]
        return dataclasses.replace(a, qpos=last.masked_fill(a.slots == self.dummy_slot, 0))


@dataclass(frozen=True)
class StepNames:
    """Step names (format fields: i the layer, j the next one); tests, profiles and graph stats read them."""

    first: str
    attn: str
    post: str
    last: str


def decoder_steps(
    layers: Sequence[Layer],
    cache: KVCache,
    source: AttnSource,
    names: StepNames,
    *,
    start: Optional[Callable[[dict], Tensor]] = None,
    finish: Optional[EnvFn] = None,
    capture: Optional[tuple[int, ...]] = None,
    kernel: bool = False,
    causal: bool = False,
    max_rows: Optional[int] = None,
    meta: Optional[dict] = None,
) -> list[Step]:
    """The forward of `layers` as 1 + 2 * len(layers) steps (see the module docstring).

    start: env -> the stream entering layer 0 [b, t, h], written to env x with delta None (None: the
      first layer's `pre` reads its own inputs; no stream keys are written). finish: after the last
      post (None: that post ends the forward). capture: layer ids whose entering stream is appended to
      env aux_list, created empty by the first step (None: no aux_list). kernel: the Triton attention (no mask).
      causal: env may set `causal` (LlamaModel.forward's prefill of fresh rows). max_rows: the
      attention's split switch (Attention.attend). meta: each step's Step.meta (a copy each).
    """
    n = len(layers)
    extra = source.kv_extra
    pre0 = layers[0].pre
    keep = capture is not None
    capture = capture or ()
    capture0 = 0 in capture

    def first(env):
        if source.dtype is not None:
            env[ATTN] = source.build(env, source.dtype)
        if start is not None:
            x = start(env)
            env[STREAM], env[DELTA] = x, None  # residual stream = x + delta
            if source.dtype is None:
                env[ATTN] = source.build(env, x.dtype)
        if keep:
            env[AUX_LIST] = []
        pre0(env)
        if capture0:  # the stream entering layer 0
            env[AUX_LIST].append(env[STREAM])

    def attend(i: int) -> EnvFn:
        att = layers[i].attention

        if i == 0:

            def fn(env):
                c = env.get(CAUSAL, False) if causal else False
                env[MASK] = None if kernel or c else env[ATTN].mask(env["kv_len"] + extra)
                env[ATTN_OUT] = att.attend(env[QUERY], cache, env[MASK], env[ATTN], c, max_rows)

        else:

            def fn(env):
                c = env.get(CAUSAL, False) if causal else False
                env[ATTN_OUT] = att.attend(env[QUERY], cache, env[MASK], env[ATTN], c, max_rows)

        return fn

    def segment(i: int) -> EnvFn:
        post = layers[i].post
        if i + 1 == n:
            if finish is None:
                return post

            def fn(env):
                post(env)
                finish(env)

            return fn
        pre = layers[i + 1].pre
        if i + 1 in capture:

            def fn(env):
                post(env)
                pre(env)
                env[AUX_LIST].append(env[STREAM])  # the stream entering layer i + 1

            return fn

        def fn(env):
            post(env)
            pre(env)

        return fn

    meta = meta or {}
    steps = [Step(names.first, first, meta=dict(meta))]
    for i in range(n):
        steps.append(Step(names.attn.format(i=i), attend(i), is_break=True, meta=dict(meta)))
        name = (names.post if i + 1 < n else names.last).format(i=i, j=i + 1)
        steps.append(Step(name, segment(i), meta=dict(meta)))
    return steps
