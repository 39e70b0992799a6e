"""The shared base of the weighted draft heads (EAGLE3, EAGLE, multi-layer EAGLE, DFlash).

A head is one (or a few) Llama decoder layers over a static KV cache of its own; it takes the target's
token embeddings and, unless it has an lm_head of its own, the target's lm_head (shared storage,
never a copy, kept out of state_dict). Its maths are ops (engine/ops.py), fused or not, once.

    forward(hidden, cache, a, tokens | embeds, sampled) -> DraftOut   (EAGLE3, EAGLE: one step)
        hidden [b, t, F or H], tokens [b, t] -> out_hidden [b, t, H], logits [b, t, V], ids [b, t]
    attn_inputs(positions, valid, kv_len)  the call's AttnInputs over the head's cache
    logits(h)        out_hidden [..., H] -> logits [..., V] (a sampled first proposal at the prefill)

`llama_config` is the Llama shape of a one-layer head of the target's width: every algorithm's
config.json builds on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from engine.model import ModelArgs, StaticKVCache, fuse_gate_up, fuse_linears, rope_tables, scale_embeddings
from engine.ops import AttnInputs, Live


@dataclass
class DraftOut:
    """A draft forward's outputs: out_hidden [b, t, H] (pre-norm), logits [b, t, V] (the plain path, or
    sampled) and ids [b, t] (the greedy proposal in target ids; the fused sampled path forms none)."""

    hidden: Tensor
    logits: Optional[Tensor]
    ids: Optional[Tensor]


class HeadBase(nn.Module):
    """Shared plumbing of every weighted draft head (the `DraftHead` protocol of engine/drafts/base.py):
    draft args, RoPE tables, its own cache, the target's embedding and lm_head (not submodules), the
    three-step program over `pre`/`post`, copy and save. Subclasses define the layers, `pre`, `post`,
    `feature_width`; heads with other programs (multi-layer, DFlash) override them."""

    architecture: str
    n_aux: int = 1

    def __init__(self, cfg: dict[str, Any], max_seq_len: int):
        super().__init__()
        self.config = dict(cfg)
        self.args = ModelArgs.from_hf_config({**cfg, "num_hidden_layers": 1})
        self.max_seq_len = max_seq_len
        self.embed_ref: list[nn.Embedding] = []  # the target's embedding, set by bind()
        self.target_ref: list[nn.Module] = []  # the target itself (lists keep them out of state_dict)
        self.target_lm_head: list[nn.Linear] = []  # the target's lm_head (set by bind())
        self.embed_scale = 1.0  # the target's embedding scale (Gemma: sqrt(hidden)), set by bind()
        self.attention_kernel = False  # follows the target's choice in bind()
        self.fused = False  # the fused Triton path (use_fused_kernels; inference drafts on a fused target)

    @property
    def lm_head(self) -> nn.Linear:
        """The head's own lm_head (an EAGLE3 draft vocabulary) if it has one, else the target's."""
        own = self._modules.get("lm_head")
        return own if own is not None else self.target_lm_head[0]

    @property
    def shares_lm_head(self) -> bool:
        """Predicts over the target's vocabulary through the target's lm_head (nothing of it stored)."""
        return self._modules.get("lm_head") is None

    @property
    def cache_slots(self) -> int:
        """Slots of the head's KV cache (and RoPE rows): the target's by default."""
        return self.max_seq_len

    def init_buffers(self, device: Optional[torch.device] = None) -> None:
        with torch.device("cpu"):
            cos, sin = rope_tables(self.args, self.cache_slots + 1)
        device = device or next(self.parameters()).device
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def new_cache(self, batch_size: int) -> StaticKVCache:
        p = next(self.parameters())
        return StaticKVCache(self.args, batch_size, self.cache_slots, p.device, p.dtype)

    def bind(self, target) -> "HeadBase":
        """Share the target's token embedding and lm_head (same storage; kept out of state_dict)."""
        self.target_ref = [target]
        self.embed_ref = [target.model.embed_tokens]
        self.target_lm_head = [target.lm_head]
        self.embed_scale = target.args.embed_scale
        self.attention_kernel = target.attention_kernel
        return self

    @property
    def embed(self) -> nn.Embedding:
        """The target's embedding table (unscaled: `embed_tokens` is what the target's first layer takes)."""
        return self.embed_ref[0]

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens [b, t] -> [b, t, H]: the target's embeddings as its first layer takes them (Gemma: scaled)."""
        return scale_embeddings(self.embed(tokens), self.embed_scale)

    def embed_gather(self, tokens: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """(table, rows) for a fused kernel that gathers the embeddings of `tokens`: the target's table and
        the ids, or, under an embedding scale, the scaled embeddings [b, t, H] and no ids."""
        return (self.embed.weight, tokens) if self.embed_scale == 1.0 else (self.embed_tokens(tokens), None)

    def graph_meta(self) -> dict:
        """The target storage a captured draft graph reads (hazard 7: capture after sharing the
        target's embedding and lm_head)."""
        return {"embed_ptr": self.embed.weight.data_ptr(), "lm_head_ptr": self.lm_head.weight.data_ptr()}

    def copy(self, device=None, dtype: Optional[torch.dtype] = None) -> "HeadBase":
        """A head of the same type and config with this one's weights in its own storage, on `device`
        in `dtype` (integer buffers such as d2t keep theirs), bound to the same target embedding."""
        head = type(self)(self.config, self.max_seq_len)
        head.load_state_dict({k: v.detach() for k, v in self.state_dict().items()})
        head.to(device=device, dtype=dtype)
        head.init_buffers(device)
        return head.bind(self.target_ref[0]) if self.target_ref else head

    def use_fused_kernels(self) -> None:
        """The fused Triton path (kernels/gemv.py, kernels/fused.py), as the target's: projections that
        read one input become one weight (views, in place: for inference heads, never a trained one)."""
        layer = self.layer
        att = layer.self_attn
        layer.qkv_weight, layer.qkv_bias = fuse_linears([att.q_proj, att.k_proj, att.v_proj])
        layer.gate_up_weight, layer.gate_up_bias = fuse_gate_up(layer.mlp)
        for op in self.ops():
            op.fuse()
        self.fused = True

    def ops(self) -> list:
        """The head's ops (engine/ops.py), fused by use_fused_kernels."""
        return [self.qkv_in, self.mlp_out, self.out]

    def attn_inputs(self, positions: Tensor, valid: Optional[Tensor], kv_len, dtype=None, **kw) -> AttnInputs:
        """One call's attention metadata over the head's cache (kv_len: an int or a graph's `Live`)."""
        return AttnInputs.build(
            positions,
            valid,
            self.rope_cos,
            self.rope_sin,
            self.cache_slots,
            dtype or next(self.parameters()).dtype,
            kv_len=Live.of(kv_len),
            kernel=self.attention_kernel,
            **kw,
        )

    def forward(
        self,
        hidden: Tensor,
        cache: StaticKVCache,
        a: AttnInputs,
        tokens: Optional[Tensor] = None,
        embeds: Optional[Tensor] = None,
        sampled: bool = False,
        pick: Optional[Callable[[Tensor], Tensor]] = None,
    ) -> "DraftOut":
        """One step of a one-layer EAGLE-family head: hidden [b, t, F or H], tokens [b, t] (or their
        embeds [b, t, H]) -> out_hidden [b, t, H], logits and / or ids (see DraftOut). pick: [b, t, H] ->
        [b, t', H], the positions the output head reads (a prefill's last: every position writes KV)."""
        g, q = self.qkv_in(tokens, embeds, hidden, cache, a)  # g [b, t, H]: the layer's residual; q: RoPE'd
        h, delta = self.mlp_out(g, self.attention(q, cache, a), a)  # attention: eager under a breakable graph
        if pick is not None:
            h, delta = pick(h), (None if delta is None else pick(delta))
        return self.out(h, delta, sampled)

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids; the identity for heads over the target's vocabulary."""
        return draft_ids

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**self.config, "architectures": [self.architecture]}, indent=2))


def llama_config(target: ModelArgs, architecture: str) -> dict:
    """config.json of a one-layer head of the target's shape named `architecture` (random init, training)."""
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
    }
