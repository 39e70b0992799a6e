"""The model's ops: each a plain-torch forward (the reference) and a fused one (the Triton kernels), chosen
once by `fuse()`, so a layer calls the op and never branches (vLLM's CustomOp).

    AttnInputs                 per-call attention metadata every layer reads: slots, RoPE rows, query bounds,
                               which attention runs, the live kv_len (a `Live` box an eager replay refreshes)
    QKVIn(layer)               (x, delta) -> (h = x + delta, q [b, heads, t, d]): norm, q/k/v, (q/k norms),
                               RoPE, k/v write
    MLPOut(layer)              (h, o [b, t, heads * d]) -> (h + o_proj(o), mlp(norm(...))): the next delta;
                               with Gemma's sandwich norms, each sublayer's output normed before it is added

The residual stream is carried as (x, delta): a sublayer's output is added by the next norm, which the
fused path does in one kernel. Ops hold no parameters of their own (state_dict names are the layer's).
Fused ops run the batch-invariant rows kernels (kernels/gemv.py) for decode-sized steps (`rows_kernel`)
and cuBLAS for prefills; an op built with `always_rows` (the EAGLE heads) runs the rows kernels always.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.decode_attention import slot_mask
from kernels.fused import add_rmsnorm, rope_cache_write
from kernels.gemv import add_rmsnorm_gemv, gemv

ROWS_KERNEL_TOKENS = 16  # tokens per row up to which the fused path runs the rows kernels (kernels/gemv.py)
THROUGHPUT_ROWS = 64  # batch_invariant=False: rows (batch x tokens) above which a step runs on cuBLAS


def rows_kernel(x: Tensor, max_rows: Optional[int] = None) -> bool:
    """[b, t, h] activations of a decode, verify or draft step (t <= ROWS_KERNEL_TOKENS, any b): the
    batch-invariant rows kernels, whose result for a row never depends on the rows beside it; prefill
    stays on cuBLAS. Static per shape, so a graph keeps it. `max_rows` (batch_invariant off): more rows
    than that go to cuBLAS too (the attention's split count follows the same switch)."""
    return x.shape[1] <= ROWS_KERNEL_TOKENS and (max_rows is None or x.shape[0] * x.shape[1] <= max_rows)


class Live:
    """A host value read at call time (the live kv_len, the host's mirror of the batch): a breakable
    graph's eager call reads it at replay, after the runner set it, instead of the value it saw at
    capture. `live + n` is a view that reads the same int plus n (a verify's k + 1, a draft step's i)."""

    __slots__ = ("_value", "base", "offset", "_version")

    def __init__(self, value=None, base: Optional["Live"] = None, offset: int = 0):
        self._value, self.base, self.offset, self._version = value, base, offset, 0

    @property
    def value(self):
        return self._value if self.base is None else self.base.value + self.offset

    @value.setter
    def value(self, v) -> None:
        self._value, self._version = v, self._version + 1

    @property
    def version(self) -> int:
        """Times the value was set (a replay sets it once): what is derived from it is stale after a set,
        even of the same value, since the tensors beside it changed (a batch whose longest row stopped)."""
        return self._version if self.base is None else self.base.version

    def __add__(self, n: int) -> "Live":
        return Live(base=self, offset=n)

    @staticmethod
    def of(x) -> "Live":
        return x if isinstance(x, Live) else Live(x)


@dataclass
class AttnInputs:
    """Per-call attention metadata shared by every layer: RoPE positions, cache slots, query bounds.

    The fused RoPE kernel reads the fp32 tables at `rope_pos`; the plain path gathers cos / sin rows (on
    first use). The mask depends on the live kv_len (`kv_len.value` + `kv_extra`), built once per set of it.
    `kernel`: the Triton attention (each row's live prefix from qpos; no mask). `causal`: fresh rows at
    positions 0..t-1 (SDPA's causal kernel). `max_rows`: batch_invariant off (see rows_kernel).
    """

    slots: Tensor  # [b, t] cache slot each token writes (padding -> the dummy slot)
    rope_pos: Tensor  # [b, t] each token's position (padding -> 0): its RoPE row
    qpos: Tensor  # [b, t] position each query attends up to (padding -> 0; DFlash: the block's last)
    max_kv: int  # the cache's slots (the dummy slot excluded)
    rope_cos: Tensor  # [max_pos, head_dim] float32 tables
    rope_sin: Tensor
    dtype: torch.dtype  # the activations'
    qlo: Optional[Tensor] = None  # [b, t] first slot each query attends (a sliding window); None: slot 0
    kv_len: Live = field(default_factory=Live)  # attend over slots < kv_len.value + kv_extra
    kv_extra: int = 0
    kernel: bool = False
    causal: bool = False
    max_rows: Optional[int] = None
    _mask: tuple = (None, None)  # ((kv_len, its version), mask) of the last mask built

    @classmethod
    def build(
        cls,
        positions: Tensor,
        valid: Optional[Tensor],
        rope_cos: Tensor,
        rope_sin: Tensor,
        dummy_slot: int,
        dtype: torch.dtype,
        **kw,
    ) -> "AttnInputs":
        if valid is not None:
            slots = torch.where(valid, positions, dummy_slot)
            positions = torch.where(valid, positions, 0)
        else:
            slots = positions
        return cls(slots, positions, positions, dummy_slot, rope_cos, rope_sin, dtype, **kw)

    def windowed(self, window: int, rope_cos: Tensor, rope_sin: Tensor) -> "AttnInputs":
        """A sliding-window layer's metadata: each query reads slots > its position - window (qlo), RoPE
        from these tables; the same slots, bounds and live kv_len. SDPA's causal kernel has no window:
        a windowed causal call runs on the mask (or the Triton kernel)."""
        qlo = (self.rope_pos - (window - 1)).clamp(min=0)  # [b, t]
        fields = dict(qlo=qlo, rope_cos=rope_cos, rope_sin=rope_sin, causal=False, _mask=(None, None))
        return dataclasses.replace(self, **fields)

    @functools.cached_property
    def cos(self) -> Tensor:
        """[b, 1, t, head_dim] in the activations' dtype (the plain path's apply_rope)."""
        return self.rope_cos[self.rope_pos].to(self.dtype)[:, None]

    @functools.cached_property
    def sin(self) -> Tensor:
        return self.rope_sin[self.rope_pos].to(self.dtype)[:, None]

    def mask(self) -> Optional[Tensor]:
        """[b, 1, t, kv] bool over the live kv_len (None: the Triton kernel or SDPA's causal kernel): a
        query at position p sees slots 0..p (never the dummy slot), from qlo on when windowed."""
        if self.kernel or self.causal:
            return None
        kv = min(self.kv_len.value + self.kv_extra, self.max_kv)
        key = (kv, self.kv_len.version)  # once per call: a replay re-runs this over the positions it rewrote
        if self._mask[0] != key:
            self._mask = (key, slot_mask(self.qpos, self.qlo, kv))
        return self._mask[1]

    def rope_write(self, qkv: Tensor, cache, layer: int, heads: int, kv_heads: int, q_norm=None, k_norm=None) -> Tensor:
        """qkv [b, t, (heads + 2 kv) * d] -> q [b, heads, t, d]; k (RoPE'd), v written at the slots.
        q_norm / k_norm: the attention's per-head norms (Qwen3, Gemma 3: their kernel_weight), before RoPE."""
        eps = k_norm.variance_epsilon if k_norm is not None else 1e-6
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
            None if q_norm is None else q_norm.kernel_weight,
            None if k_norm is None else k_norm.kernel_weight,
            eps,
        )


class Op:
    """An op over a layer's weights: `forward_native` or, after `fuse()`, `forward_fused`."""

    def __init__(self, layer, always_rows: bool = False):
        self.layer, self.always_rows = layer, always_rows
        self.run = self.forward_native

    def fuse(self) -> None:
        self.run = self.forward_fused

    def __call__(self, *args):
        return self.run(*args)

    def rows(self, x: Tensor, a: AttnInputs) -> bool:
        return self.always_rows or rows_kernel(x, a.max_rows)


def sublayer_norms(layer) -> tuple:
    """(attention output norm or None, MLP input norm, MLP output norm or None) of a layer, by HF's
    names: a layer with pre_feedforward_layernorm (Gemma) norms both sublayers' outputs."""
    pre = getattr(layer, "pre_feedforward_layernorm", None)
    if pre is None:
        return None, layer.post_attention_layernorm, None
    return layer.post_attention_layernorm, pre, layer.post_feedforward_layernorm


def _normed(norm, y: Tensor) -> Tensor:
    """y normed by `norm` on the fused path (a row kernel: batch-invariant); y without a norm."""
    return y if norm is None else add_rmsnorm(y, None, norm.kernel_weight, norm.variance_epsilon)[1]


class QKVIn(Op):
    """input_layernorm, q/k/v, q/k norms, RoPE and the cache write of a layer: (x, delta) -> (h, q)."""

    def forward_native(self, x: Tensor, delta: Optional[Tensor], cache, a: AttnInputs) -> tuple[Tensor, Tensor]:
        layer = self.layer
        h = x if delta is None else x + delta  # [b, t, hidden]
        return h, layer.self_attn.project(layer.input_layernorm(h), cache, a)

    def forward_fused(self, x: Tensor, delta: Optional[Tensor], cache, a: AttnInputs) -> tuple[Tensor, Tensor]:
        layer, att, norm = self.layer, self.layer.self_attn, self.layer.input_layernorm
        w, eps = norm.kernel_weight, norm.variance_epsilon
        if self.rows(x, a):  # decode / verify: the norm in the projection's prologue
            h, qkv = add_rmsnorm_gemv(x, delta, w, eps, layer.qkv_weight, layer.qkv_bias)
        else:
            h, n = add_rmsnorm(x, delta, w, eps)
            qkv = F.linear(n, layer.qkv_weight, layer.qkv_bias)  # [b, t, (heads + 2 kv) * d]
        return h, a.rope_write(qkv, cache, att.layer_idx, att.n_heads, att.n_kv, att.q_norm, att.k_norm)


class MLPOut(Op):
    """o_proj, + residual, the MLP's input norm and the gated MLP (sublayer_norms: Gemma's outputs normed
    too): (h, o) -> (h, the MLP's output: the next delta)."""

    def forward_native(self, h: Tensor, o: Tensor, a: AttnInputs) -> tuple[Tensor, Tensor]:
        layer = self.layer
        attn_out, mlp_in, mlp_out = sublayer_norms(layer)
        o = layer.self_attn.o_proj(o)  # [b, t, hidden]
        h = h + (o if attn_out is None else attn_out(o))
        y = layer.mlp(mlp_in(h))
        return h, (y if mlp_out is None else mlp_out(y))

    def forward_fused(self, h: Tensor, o: Tensor, a: AttnInputs) -> tuple[Tensor, Tensor]:
        layer = self.layer
        attn_out, norm, mlp_out = sublayer_norms(layer)
        o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
        if self.rows(h, a):  # three row kernels: the norm in a prologue, the gated activation in an epilogue
            h, act = add_rmsnorm_gemv(
                h,
                _normed(attn_out, gemv(o, o_proj.weight, o_proj.bias)),
                norm.kernel_weight,
                norm.variance_epsilon,
                layer.gate_up_weight,
                layer.gate_up_bias,
                glu=layer.mlp.act,
            )  # [b, t, h], [b, t, inter]
            return h, _normed(mlp_out, gemv(act, down.weight, down.bias))
        h, n = add_rmsnorm(h, _normed(attn_out, o_proj(o)), norm.kernel_weight, norm.variance_epsilon)
        return h, _normed(mlp_out, layer.mlp(n))  # prefill: cuBLAS through the gate / up views of gate_up_weight


class AddNorm(Op):
    """+ residual and an RMSNorm (a model's final norm): (x, delta) -> (h = x + delta, norm(h))."""

    def forward_native(self, x: Tensor, delta: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        h = x if delta is None else x + delta
        return h, self.layer(h)

    def forward_fused(self, x: Tensor, delta: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        return add_rmsnorm(x, delta, self.layer.kernel_weight, self.layer.variance_epsilon)


class LMHead(Op):
    """A bias-free lm_head: h [b, t, hidden] -> (logits [b, t, vocab] or None, ids [b, t] or None). With
    `greedy` the ids are the argmax; the fused rows kernel takes it in its epilogue and forms no logits."""

    def forward_native(self, h: Tensor, a: AttnInputs, greedy: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
        logits = self.layer(h)
        return logits, (logits.argmax(-1) if greedy else None)

    def forward_fused(self, h: Tensor, a: AttnInputs, greedy: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
        if not self.rows(h, a):  # cuBLAS would pick its kernel by the row count: rows kernels for steps
            return self.forward_native(h, a, greedy)
        if greedy:
            return None, gemv(h, self.layer.weight, argmax=True)  # [b, t]
        return gemv(h, self.layer.weight), None
