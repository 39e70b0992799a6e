"""The shared base of the weighted draft heads (EAGLE3, EAGLE, multi-layer EAGLE, DFlash).

A head is one (or a few) Llama decoder layers over a static KV cache of its own, reusing the target's
attention module and RoPE; it takes the target's token embeddings and, unless it has an lm_head of
its own, the target's lm_head (shared storage, never a copy, kept out of state_dict).

    program(cache)   one draft forward as steps: pre (segment) -> attention (break) -> post (segment),
                     built by engine/decoder.py's `decoder_steps` with `pre` / `post` as the one layer
    pre(env, ...)    env hidden [b, t, F or hidden], tokens [b, t], attn -> g [b, t, hidden], q [b, heads, t, d]
    post(env, sampled)  env g, o [b, t, heads * d] -> out_hidden [b, t, hidden], ids [b, t] (greedy) or
                     logits [b, t, V] (sampled; the unfused path forms both)
    logits(h)        out_hidden [..., hidden] -> logits [..., V] (a sampled first proposal at the prefill)

`llama_config` is the Llama shape of a one-layer head of the target's width: every algorithm's
config.json builds on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from engine.decoder import AttnInputs, AttnSource, EnvLayer, StepNames, decoder_steps
from engine.model import ModelArgs, StaticKVCache, fuse_gate_up, fuse_linears, rope_tables
from engine.program import Step


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
        self.attention_kernel = target.attention_kernel
        return self

    @property
    def embed(self) -> nn.Embedding:
        return self.embed_ref[0]

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
        att = self.attention
        self.qkv_weight, self.qkv_bias = fuse_linears([att.q_proj, att.k_proj, att.v_proj])
        self.gate_up_weight, self.gate_up_bias = fuse_gate_up(self.mlp_module)
        self.fused = True

    def _embed_rows(self, env: dict, embeds: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        """(table, row index) for a fused prologue: the given embeddings, or the target's embedding
        table gathered by token id inside the kernel."""
        return (embeds, None) if embeds is not None else (self.embed.weight, env["tokens"])

    def _attend_fused(self, qkv: Tensor, cache: StaticKVCache, a: AttnInputs) -> Tensor:
        """qkv [b, t, (heads + 2 kv) * d] -> q [b, heads, t, d]; k (RoPE'd) and v written at a.slots."""
        att = self.attention
        return a.rope_write(qkv, cache, 0, att.n_heads, att.n_kv)

    def program(self, cache: StaticKVCache, *, embeds_input: bool = False, sampled: bool = False) -> list[Step]:
        """One draft forward as steps (segment, attention break, segment) over an env dict.

        env in:  tokens [b, t], hidden [b, t, F or hidden], positions [b, t], valid [b, t], kv_len,
                 input_embeds [b, t, hidden] (embeds_input)
        env out: out_hidden [b, t, hidden] (pre-norm: the next step's input), ids [b, t] (the greedy
                 proposal, target ids), logits [b, t, draft vocab] (unfused path, or `sampled`: the
                 fused greedy path takes the argmax inside the lm_head kernel and writes no logits, the
                 sampled one writes the logits and no ids)
        """

        def pre(env):  # the layer's input fusion (embeds, hidden) and q/k/v: the head's own
            self.pre(env, env["input_embeds"] if embeds_input else None, cache)

        def post(env):
            self.post(env, sampled)

        dtype = next(self.parameters()).dtype
        return decoder_steps(
            [EnvLayer(self.attention, pre, post)],
            cache,
            AttnSource(self, cache.dummy_slot, dtype),
            StepNames("draft_pre", "draft_attn", "", "draft_post"),
            kernel=self.attention_kernel,
            meta=self.graph_meta(),
        )

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
