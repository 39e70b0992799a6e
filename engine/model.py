"""The target model: one transformer (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3) over a static KV cache.

    tokens [b, t] (or input_embeds [b, t, hidden]), positions [b, t], valid [b, t] (False: padding,
    written to the dummy slot) -> logits [b, t or 1, vocab], hidden [b, t, hidden], aux hidden states
    kv cache [layers, b, kv_heads, max_seq + 1, head_dim] (slot max_seq: the dummy)

One forward serves prefill, decode and verify; a token at position p sees slots 0..p of its row (a
sliding layer: p - window + 1..p).
`forward` reads top to bottom; the fused kernels hide in the ops each layer calls (engine/ops.py), and
the attention is the one call a breakable graph runs eagerly. Parameter names are Hugging Face's
(`model.layers.N.self_attn.q_proj.weight`); aux layer ids follow `input_of` (id N: the last layer's
output). RMSNorm and RoPE compute in float32, as transformers does: fp32 logits match it to ~1e-6.
Architectures differ only in ModelArgs fields: Qwen3's and Gemma 3's q/k norms (`qk_norm`: each q and k
head normed over head_dim before RoPE) and Gemma 3's (`ARCH_FIELDS`): the norm's (1 + w), the MLP's
activation, the norms on each sublayer's output, the embedding scale, per-layer sliding windows and their
RoPE base. The layer, attention and MLP are written once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.graphs.breakable import eager
from engine.ops import THROUGHPUT_ROWS, AddNorm, AttnInputs, Live, LMHead, MLPOut, QKVIn
from kernels.decode_attention import decode_attention
from kernels.fused import rotate_half
from kernels.gemv import interleave_gate_up

QK_NORM_MODEL_TYPES = ("qwen3",)  # model_types whose attention norms each q / k head
QKV_BIAS_MODEL_TYPES = ("qwen2", "mimo")  # model_types whose q/k/v projections have biases (MiMo: Qwen2 layers)


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"rope_type": "llama3"|"linear"|"default", ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q/k/v biases
    o_bias: bool = False  # Llama's attention_bias: every projection has one
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head (weight [head_dim]) before RoPE
    max_position_embeddings: int = 2048
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_act: str = "silu"  # the gated MLP's activation (ACTIVATIONS): silu (SwiGLU), gelu_pytorch_tanh (GeGLU)
    norm_unit_offset: bool = False  # Gemma: every RMSNorm scales by (1 + w), in float32
    sandwich_norms: bool = False  # Gemma: norms on the attention's and the MLP's outputs too (see DecoderLayer)
    embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(hidden)), in their dtype
    attn_scale: Optional[float] = None  # scores times this; None: head_dim ** -0.5
    sliding_window: int = 0  # positions a sliding_attention layer sees (its own included)
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention; (): all full
    rope_local_theta: Optional[float] = None  # the sliding layers' RoPE base (no scaling); None: rope_theta

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """From a checkpoint's config.json (transformers 4.x and 5.x spellings)."""
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        fields = cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type in QKV_BIAS_MODEL_TYPES or attention_bias,
            o_bias=attention_bias and model_type not in QKV_BIAS_MODEL_TYPES,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=cfg.get("hidden_act", "silu"),
        )
        arch = ARCH_FIELDS.get(model_type)
        args = dataclasses.replace(fields, **arch(cfg)) if arch else fields
        if args.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={args.hidden_act!r} is not supported; valid: {sorted(ACTIVATIONS)}")
        return args

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + norms
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text (transformers 4.x keys rope_theta / rope_local_base_freq / rope_scaling /
    sliding_window_pattern, or 5.x rope_parameters per layer type and layer_types)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):  # Gemma 2's softcaps, EmbeddingGemma's bidirectional attention: not implemented
            raise ValueError(f"{key}={cfg[key]!r} is not supported; valid: null (as Gemma 3's text models)")
    n, rope = cfg["num_hidden_layers"], cfg.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or cfg.get("rope_scaling") or {})
    local = dict(rope.get("sliding_attention") or {})
    rope_type = full.get("rope_type", full.get("type", "default"))
    pattern = cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return dict(
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        norm_unit_offset=True,
        sandwich_norms=True,
        qk_norm=True,
        embed_scale=cfg["hidden_size"] ** 0.5,
        attn_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
        rope_scaling=None if rope_type == "default" else {**full, "rope_type": rope_type},
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
        sliding_window=cfg.get("sliding_window") or 0,
        layer_types=tuple(types),
    )


ARCH_FIELDS = {"gemma3_text": _gemma3_fields}  # model_type -> its ModelArgs fields beyond Llama's
LAYER_TYPES = ("full_attention", "sliding_attention")  # Hugging Face's names


def init_normal_(module: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Normal(0, std) weights, unit norms (w = 1, or w = 0 where the norm scales by 1 + w), zero biases
    (transformers' init), from a fixed seed, drawn on the parameters' device (a CPU draw is the same on
    every host)."""
    device = next(module.parameters()).device
    g = torch.Generator(device).manual_seed(seed)
    offset = {n + ".weight" for n, m in module.named_modules() if getattr(m, "unit_offset", False)}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if name in offset else 1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif device.type == "cpu":
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.normal_(0.0, std, generator=g)
    return module


# --------------------------------------------------------------------------------------------- RoPE
def _inv_freq_default(args: ModelArgs) -> Tensor:
    d = args.head_dim
    return 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def _inv_freq_linear(args: ModelArgs) -> Tensor:
    return _inv_freq_default(args) / float(args.rope_scaling["factor"])


def _inv_freq_llama3(args: ModelArgs) -> Tensor:
    s = args.rope_scaling
    inv = _inv_freq_default(args)
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


ROPE_INV_FREQ = {"default": _inv_freq_default, "linear": _inv_freq_linear, "llama3": _inv_freq_llama3}


def rope_tables(args: ModelArgs, max_seq_len: int, layer_type: str = "full_attention") -> tuple[Tensor, Tensor]:
    """cos, sin: [max_seq_len, head_dim] in float32 (the half-rotation layout of HF Llama); a
    sliding_attention layer's with rope_local_theta (Gemma 3: its own base, no scaling)."""
    if layer_type == "sliding_attention" and args.rope_local_theta is not None:
        args = dataclasses.replace(args, rope_theta=args.rope_local_theta, rope_scaling=None)
    rope_type = (args.rope_scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_INV_FREQ:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; valid: {sorted(ROPE_INV_FREQ)}")
    inv_freq = ROPE_INV_FREQ[rope_type](args)  # [head_dim/2]
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_seq, head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [batch, 1, seq, head_dim] in x's dtype."""
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------------------------- cache
class StaticKVCache:
    """Keys and values of every layer, allocated once: [layers, batch, kv_heads, max_seq + 1, head_dim].

    Slot `max_seq_len` is a dummy that padding tokens write into, so a padded row never touches a
    live slot. Which slots are live is the caller's business (positions); the cache holds no lengths.
    """

    def __init__(self, args: ModelArgs, batch_size: int, max_seq_len: int, device, dtype):
        shape = (args.num_layers, batch_size, args.num_kv_heads, max_seq_len + 1, args.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len

    @property
    def dummy_slot(self) -> int:
        return self.max_seq_len

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def rows(self, n: int | slice) -> "StaticKVCache":
        """Rows sharing storage: the first n (a batch smaller than the cache), or a contiguous slice
        (one request's slot under continuous batching, a sub-batch's draft prefill)."""
        sl = n if isinstance(n, slice) else slice(0, n)
        view = object.__new__(StaticKVCache)
        view.k, view.v = self.k[:, sl], self.v[:, sl]
        view.batch_size, view.max_seq_len = view.k.shape[1], self.max_seq_len
        return view

    def take(self, src: "StaticKVCache", width: int) -> None:
        """Slots 0..width-1 of src's first rows into this view's rows (a prefill staged elsewhere)."""
        b = self.batch_size
        self.k[:, :, :, :width].copy_(src.k[:, :b, :, :width])  # [layers, b, kv_heads, width, head_dim]
        self.v[:, :, :, :width].copy_(src.v[:, :b, :, :width])

    def put(self, src: "StaticKVCache", rows: list[int], width: int) -> None:
        """Slots 0..width-1 of src's rows 0..n-1 into rows `rows` of this cache, in any order (a joint
        prefill staged elsewhere, its prompts joining at free slots wherever they are)."""
        n = len(rows)
        if rows == list(range(rows[0], rows[0] + n)):
            self.rows(slice(rows[0], rows[0] + n)).take(src, width)
            return
        idx = torch.tensor(rows, device=self.k.device)
        self.k[:, idx, :, :width] = src.k[:, :n, :, :width]  # one scatter per tensor
        self.v[:, idx, :, :width] = src.v[:, :n, :, :width]


# --------------------------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    """w * rmsnorm(x), the normed value rounded to x's dtype first (Llama); with unit_offset (Gemma),
    round(rmsnorm(x) * (1 + w)) in float32, w starting at 0. The fused kernels multiply by
    `kernel_weight`: w, or 1 + w folded in float32 once by `fuse()`."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.variance_epsilon, self.unit_offset = eps, unit_offset
        self.folded: Optional[Tensor] = None  # 1 + w in float32, set by fuse()

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def scale(self) -> Tensor:
        """What the normed value is multiplied by: w, or 1 + w in float32 (a draft head's init copies it)."""
        return 1.0 + self.weight.float() if self.unit_offset else self.weight

    def fuse(self) -> None:
        if self.unit_offset:
            self.folded = self.scale().detach().contiguous()

    @property
    def kernel_weight(self) -> Tensor:
        return self.weight if self.folded is None else self.folded


def make_norm(args: ModelArgs, dim: Optional[int] = None) -> RMSNorm:
    return RMSNorm(dim or args.hidden_size, args.rms_norm_eps, args.norm_unit_offset)


class Attention(nn.Module):
    """GQA self-attention over a static cache. `in_features` > hidden for EAGLE3's [embed, hidden] input.

    `project` (q/k/v, RoPE, cache write) feeds `forward` (the attention over the live prefix of the
    cache: the one call a breakable graph runs eagerly). With `args.qk_norm`, q_norm / k_norm (built by
    `norm(head_dim, eps)`, the model's RMSNorm kind by default) norm each q and k head before RoPE, on
    both paths. `scale`: the scores' factor (Gemma's query_pre_attn_scalar ** -0.5; None: head_dim's).
    """

    def __init__(
        self, args: ModelArgs, layer_idx: int, in_features: Optional[int] = None, norm: Optional[Callable] = None
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.attn_scale
        h, q, kv = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        d_in = in_features or h
        self.q_proj = nn.Linear(d_in, q, bias=args.qkv_bias)
        self.k_proj = nn.Linear(d_in, kv, bias=args.qkv_bias)
        self.v_proj = nn.Linear(d_in, kv, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=args.o_bias)
        # the fused op reads the q/k norms' kernel_weight and eps; Gemma's norms scale by 1 + w
        norm = norm or functools.partial(RMSNorm, unit_offset=args.norm_unit_offset)
        self.q_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    @staticmethod
    def heads(y: Tensor, n: int, norm: Optional[nn.Module]) -> Tensor:
        """y [b, t, n * head_dim] -> [b, n, t, head_dim], each head normed first where the model has q/k norms."""
        b, t, _ = y.shape
        y = y.view(b, t, n, -1)
        return (y if norm is None else norm(y)).transpose(1, 2)

    def rotary_q(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [b, t, d_in] -> q [b, heads, t, head_dim] with RoPE (cos / sin [b, 1, t, head_dim])."""
        return apply_rope(self.heads(self.q_proj(x), self.n_heads, self.q_norm), cos, sin)

    def rotary_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [b, t, d_in] -> k with RoPE, v: [b, kv_heads, t, head_dim] each."""
        k = self.heads(self.k_proj(x), self.n_kv, self.k_norm)
        return apply_rope(k, cos, sin), self.heads(self.v_proj(x), self.n_kv, None)

    def project(self, x: Tensor, cache: StaticKVCache, a: AttnInputs) -> Tensor:
        """x [b, t, d_in] -> q [b, heads, t, head_dim]; writes this call's k/v at their slots."""
        self.write_kv(x, cache, a)
        return self.rotary_q(x, a.cos, a.sin)

    def write_kv(self, x: Tensor, cache: StaticKVCache, a: AttnInputs) -> None:
        """x [b, t, d_in]: k/v projections, RoPE on k, written at a.slots (no queries: DFlash's context)."""
        b, t, _ = x.shape
        k, v = self.rotary_kv(x, a.cos, a.sin)  # [b, kv_heads, t, d]
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [b, kv_heads, S+1, d]
        idx = a.slots[:, None, :, None].expand(b, self.n_kv, t, self.head_dim)
        k_cache.scatter_(2, idx, k.to(k_cache.dtype))
        v_cache.scatter_(2, idx, v.to(v_cache.dtype))

    @eager  # SDPA over the live kv_len: eager between the captured segments of a breakable graph
    def forward(self, q: Tensor, cache: StaticKVCache, a: AttnInputs) -> Tensor:
        return self.attend(q, cache, a)

    def attend(self, q: Tensor, cache: StaticKVCache, a: AttnInputs) -> Tensor:
        """q [b, heads, t, d] -> [b, t, heads * d]. SDPA over cache[:kv_len] under `a.mask()`; with
        `a.kernel` the Triton kernel, which reads each query's live prefix (a.qpos); with `a.causal` (the
        queries are positions 0..t-1 just written to fresh rows) SDPA's causal kernel over slots 0..t-1.
        `a.max_rows` (not batch-invariant): a step of more rows runs the kernel with one split, each
        (row, kv head) program walking its whole prefix, which fills the GPU at hundreds of rows."""
        b, _, t, _ = q.shape
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]
        gqa = self.n_kv != self.n_heads
        if a.causal:
            out = F.scaled_dot_product_attention(
                q, k_cache[:, :, :t], v_cache[:, :, :t], is_causal=True, enable_gqa=gqa, scale=self.scale
            )
        elif a.kernel:
            one_split = a.max_rows is not None and b * t > a.max_rows
            splits = 1 if one_split else None
            out = decode_attention(q, k_cache, v_cache, a.qpos, num_splits=splits, qlo=a.qlo, scale=self.scale)
        else:
            mask = a.mask()  # [b, 1, t, kv_len]
            kv_len = mask.shape[-1]
            out = F.scaled_dot_product_attention(
                q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], attn_mask=mask, enable_gqa=gqa, scale=self.scale
            )  # [b, heads, t, d]
        return out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}  # HF's names


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (gelu_pytorch_tanh); `act` names the fused
    projection's epilogue too (kernels/gemv.py GLU_EPILOGUES)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=args.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=args.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=args.mlp_bias)
        self.act = args.hidden_act

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A layer over the residual stream carried as (x, delta) (engine/ops.py): its ops pick the
    plain-torch or the fused path, once. Norms in HF's names: Llama's post_attention_layernorm is the
    MLP's input norm; with sandwich_norms (Gemma) it norms the attention's output, and
    pre_feedforward_layernorm / post_feedforward_layernorm the MLP's input / output (ops.sublayer_norms).
    `layer_type`: full_attention, or sliding_attention (a window and its own RoPE tables)."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_type = args.layer_types[layer_idx] if args.layer_types else "full_attention"
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = make_norm(args)
        self.post_attention_layernorm = make_norm(args)
        if args.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = make_norm(args), make_norm(args)
        self.qkv_in, self.mlp_out = QKVIn(self), MLPOut(self)

    def forward(
        self, x: Tensor, delta: Optional[Tensor], cache: StaticKVCache, a: AttnInputs, keep: Optional[list] = None
    ) -> tuple[Tensor, Tensor]:
        """-> (the stream after attention, the MLP output: the delta the next norm adds). keep: a list
        the stream entering this layer is appended to (an aux hidden state)."""
        h, q = self.qkv_in(x, delta, cache, a)  # h = x + delta; q [b, heads, t, d]; k/v into the cache
        if keep is not None:
            keep.append(h)
        return self.mlp_out(h, self.self_attn(q, cache, a), a)  # attention: eager under a breakable graph

    def fuse_projections(self) -> None:
        """The fused path: q/k/v and gate/up weights become views of one tensor each (one matmul
        instead of 3 and 2), and the ops run the kernels."""
        att, mlp = self.self_attn, self.mlp
        self.qkv_weight, self.qkv_bias = fuse_linears([att.q_proj, att.k_proj, att.v_proj])
        self.gate_up_weight, self.gate_up_bias = fuse_gate_up(mlp)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fuse()
        self.qkv_in.fuse()
        self.mlp_out.fuse()


def fuse_linears(mods: list[nn.Linear]) -> tuple[Tensor, Optional[Tensor]]:
    """One [sum of outputs, in] weight (and bias) for linears that read the same input; each module's
    weight becomes a view of it (no copy kept)."""
    w = torch.cat([m.weight for m in mods]).contiguous()
    bias = torch.cat([m.bias for m in mods]).contiguous() if mods[0].bias is not None else None
    offset = 0
    for m in mods:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(w[offset : offset + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[offset : offset + rows], requires_grad=False)
        offset += rows
    return w, bias


def fuse_gate_up(mlp: "MLP") -> tuple[Tensor, Optional[Tensor]]:
    """The MLP's gate and up rows interleaved in one weight [2I, H] (g0, u0, g1, u1, ...: the layout of
    add_rmsnorm_gemv's gated epilogue); gate_proj / up_proj become its even / odd row views."""
    g, u = mlp.gate_proj, mlp.up_proj
    w = interleave_gate_up(g.weight, u.weight).contiguous()
    bias = interleave_gate_up(g.bias, u.bias).contiguous() if g.bias is not None else None
    for m, i in ((g, 0), (u, 1)):
        m.weight = nn.Parameter(w[i::2], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[i::2], requires_grad=False)
    return w, bias


class _Backbone(nn.Module):
    """`model.*` in HF naming: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = make_norm(args)


@dataclass
class ForwardOutput:
    logits: Tensor  # [batch, n_logits, vocab] (n_logits: seq, or 1 with logits_index)
    hidden_states: Optional[Tensor] = None  # [batch, seq, hidden]: final normed hidden states
    aux_hidden_states: Optional[Tensor] = None  # [batch, seq, hidden * len(aux_layers)]
    input_embeds: Optional[Tensor] = None  # [batch, seq, hidden]: what the first layer took

    ids: Optional[Tensor] = None  # [batch, n_logits]: the argmax (greedy; the fused rows kernel forms no logits)

    @classmethod
    def from_env(cls, env: dict) -> "ForwardOutput":
        return cls(env.get("logits"), env.get("hidden"), env.get("aux"), env.get("embeds"), env.get("ids"))


def scale_embeddings(x: Tensor, scale: float) -> Tensor:
    """Token embeddings [..., hidden] times `scale` rounded to their dtype (Gemma: sqrt(hidden), as
    transformers' Gemma3TextScaledWordEmbedding); the embeddings themselves at scale 1."""
    return x if scale == 1.0 else x * float(torch.tensor(scale, dtype=x.dtype))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, max_seq_len: int):
        super().__init__()
        self.args, self.max_seq_len = args, max_seq_len
        self.model = _Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_norm, self.head = AddNorm(self.model.norm), LMHead(self.lm_head)
        self.init_buffers()
        self.aux_layer_ids: tuple[int, ...] = ()
        self.attention_kernel = False  # True: Triton decode attention (live prefix only), else SDPA
        self.fused = False  # True: fused norm / RoPE + cache write / SwiGLU kernels (use_fused_kernels)
        self.batch_invariant = True  # set_batch_invariant

    def init_buffers(self, device: Optional[torch.device] = None) -> None:
        """(Re)build the RoPE tables in float32 on `device` (after meta-init or a dtype cast): rope_cos /
        rope_sin, and with sliding_attention layers local_cos / local_sin (their own base, if any)."""
        device = device or self.lm_head.weight.device
        tables = {"rope": "full_attention"}
        if "sliding_attention" in self.args.layer_types:
            tables["local"] = "sliding_attention"
        for name, layer_type in tables.items():
            with torch.device("cpu"):
                cos, sin = rope_tables(self.args, self.max_seq_len + 1, layer_type)  # [max_seq + 1, head_dim]
            self.register_buffer(f"{name}_cos", cos.to(device), persistent=False)
            self.register_buffer(f"{name}_sin", sin.to(device), persistent=False)

    # -- configuration --------------------------------------------------------------------------
    def set_aux_layers(self, ids: list[int] | tuple[int, ...]) -> None:
        """Capture the hidden states entering these layers (`input_of`); id N is the final output."""
        n = self.args.num_layers
        bad = [i for i in ids if not 0 <= i <= n]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"aux layer ids {list(ids)} must be unique and in [0, {n}]")
        self.aux_layer_ids = tuple(ids)

    def set_batch_invariant(self, on: bool) -> None:
        """on (the default): decode-sized steps run the rows kernels at any row count, so a row's output
        never depends on its batch; off: steps of more than THROUGHPUT_ROWS rows run on cuBLAS, for
        throughput work that compares no output across batch sizes (self-distillation). Programs and
        graphs built afterwards follow it."""
        self.batch_invariant = on

    def new_cache(self, batch_size: int, dtype: Optional[torch.dtype] = None) -> StaticKVCache:
        p = self.lm_head.weight
        return StaticKVCache(self.args, batch_size, self.max_seq_len, p.device, dtype or p.dtype)

    # -- forward ----------------------------------------------------------------------------------
    def attn_inputs(
        self, positions: Tensor, valid: Optional[Tensor], cache: StaticKVCache, dtype, kv_len, causal: bool = False
    ) -> AttnInputs:
        """This call's attention metadata; kv_len an int or a `Live` box (a graph's per-replay value)."""
        live = Live.of(cache.max_seq_len if kv_len is None else kv_len)
        return AttnInputs.build(
            positions,
            valid,
            self.rope_cos,
            self.rope_sin,
            cache.dummy_slot,
            dtype,
            kv_len=live,
            kernel=self.attention_kernel,
            causal=causal,
            max_rows=None if self.batch_invariant else THROUGHPUT_ROWS,
        )

    def layer_inputs(self, a: AttnInputs) -> dict[str, AttnInputs]:
        """Each layer type's metadata: full_attention's is `a`; sliding_attention's reads slots > p - window
        and its own RoPE tables (one per call, shared by the layers of that type)."""
        out = {"full_attention": a}
        if "sliding_attention" in self.args.layer_types:
            window = self.args.sliding_window or self.max_seq_len + 1  # no window: every slot
            out["sliding_attention"] = a.windowed(window, self.local_cos, self.local_sin)
        return out

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens [b, t] -> what the first layer takes [b, t, hidden]: the embedding times embed_scale,
        rounded to the embedding's dtype first (as transformers' Gemma3TextScaledWordEmbedding)."""
        return scale_embeddings(self.model.embed_tokens(tokens), self.args.embed_scale)

    def forward(
        self,
        tokens: Optional[Tensor],  # [batch, seq] int64
        positions: Tensor,  # [batch, seq] int64
        cache: StaticKVCache,
        *,
        valid: Optional[Tensor] = None,  # [batch, seq] bool; None: all valid
        kv_len: Optional[int | Live] = None,  # attend over cache[:kv_len]; must exceed every live position
        input_embeds: Optional[Tensor] = None,  # [batch, seq, hidden], replaces embedding of tokens
        logits_index: Optional[Tensor] = None,  # [batch]: compute logits at this seq index only
        causal: bool = False,  # positions are 0..seq-1 of fresh, right-padded rows (see Attention.attend)
        greedy: bool = False,  # also the argmax ids (the fused rows kernel: the ids only, no logits)
    ) -> ForwardOutput:
        """With `causal`, padding queries read slots this call did not write (their outputs are
        meaningless; no valid position reads them). The aux layers are read at each call."""
        x = input_embeds if input_embeds is not None else self.embed(tokens)  # [b, t, hidden]
        a = self.attn_inputs(positions, valid, cache, x.dtype, kv_len, causal)
        by_type = self.layer_inputs(a)
        aux, delta, embeds = [], None, x
        for i, layer in enumerate(self.model.layers):
            keep = aux if i in self.aux_layer_ids else None
            x, delta = layer(x, delta, cache, by_type[layer.layer_type], keep=keep)
        x, hidden = self.final_norm(x, delta)  # [b, t, hidden]: the last stream, normed
        if self.args.num_layers in self.aux_layer_ids:
            aux.append(x)
        h = hidden
        if logits_index is not None:
            h = hidden[torch.arange(hidden.shape[0], device=hidden.device), logits_index][:, None]  # [b, 1, hidden]
        logits, ids = self.head(h, a, greedy)  # [b, t or 1, vocab], [b, t or 1]
        return ForwardOutput(logits, hidden, torch.cat(aux, dim=-1) if aux else None, embeds, ids)

    def program(
        self,
        cache: StaticKVCache,
        *,
        embeds_input: bool = False,
        logits_at_index: bool = False,
        greedy: bool = False,
        causal: bool = False,
    ) -> list:
        """The forward as one step over an env dict (engine/graphs/program.py), for the round program: its
        attention runs eagerly inside a breakable graph's capture (Attention.attend is marked eager).

        env in:  tokens [b, t], positions [b, t], valid [b, t], kv_len (int), input_embeds [b, t, h]
                 (embeds_input), logits_index [b] (logits_at_index)
        env out: logits [b, t or 1, vocab], hidden [b, t, h], aux [b, t, h * n_aux] or None, embeds
                 [b, t, h]; with `greedy`, ids [b, t or 1] (the fused rows kernel writes no logits).
        The aux layers are read now: a program keeps the ids it was built with, in `Step.meta`.
        """
        from engine.graphs.program import Step

        aux_ids = self.aux_layer_ids

        def run(env: dict) -> None:
            saved, self.aux_layer_ids = self.aux_layer_ids, aux_ids
            try:
                out = self(
                    env["tokens"],
                    env["positions"],
                    cache,
                    valid=env["valid"],
                    kv_len=env["kv_len"],
                    input_embeds=env["input_embeds"] if embeds_input else None,
                    logits_index=env["logits_index"] if logits_at_index else None,
                    causal=causal,
                    greedy=greedy,
                )
            finally:
                self.aux_layer_ids = saved
            env.update(logits=out.logits, hidden=out.hidden_states, aux=out.aux_hidden_states)
            env.update(embeds=out.input_embeds, ids=out.ids)

        return [Step("forward", run, meta={"aux_layer_ids": aux_ids})]

    def use_fused_kernels(self) -> None:
        """Switch to the fused Triton path (kernels/fused.py); projections are fused in place."""
        for layer in self.model.layers:
            layer.fuse_projections()
        self.model.norm.fuse()
        self.final_norm.fuse()
        self.head.fuse()
        self.fused = True
