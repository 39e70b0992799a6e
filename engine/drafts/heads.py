"""EAGLE-family draft heads and their checkpoints: `Eagle3Head` and `EagleHead` (EAGLE-1/2).

Both are one Llama decoder layer over a static KV cache of their own, reusing the target's attention
module and RoPE; both take the target's token embeddings (shared storage, never a copy).

EAGLE3 (public format, `architectures: ["LlamaForCausalLMEagle3"]`):

    g   = fc(aux)                      aux [b, t, n_aux * target_hidden] -> [b, t, hidden]   (first step)
    g   = previous draft output        [b, t, hidden]                                        (later steps)
    x   = cat(input_layernorm(embed(tok)), hidden_norm(g))           [b, t, 2 * hidden]
    h   = g + o_proj(attn(q/k/v_proj(x)));  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))          [b, t, draft_vocab];  target id = draft id + d2t[draft id]

    tensors: fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
             midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
             norm.weight, lm_head.weight, d2t [draft_vocab] int64, t2d [vocab] bool
    config:  draft_vocab_size, target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids (output_of)

    Without `draft_vocab_size` in config.json the head predicts over the target's whole vocabulary
    through the target's lm_head (shared storage, frozen): no lm_head, d2t or t2d is stored. This is
    sglang's `load_lm_head_from_target` convention; every target token can be drafted.

EAGLE (feature-level, `architectures: ["LlamaForCausalLMEagle"]`): the feature is the target's final
normed hidden state; h = layer(fc(cat(embed(tok), f))) with no input norm, logits = target lm_head(h).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from engine.drafts.storage import SCALE_SUFFIX, read_state, safetensors_shapes
from engine.errors import ConfigError
from engine.model import (
    MLP,
    Attention,
    AttnInputs,
    ModelArgs,
    RMSNorm,
    StaticKVCache,
    fuse_gate_up,
    fuse_linears,
    rope_tables,
)
from engine.program import Step
from kernels.gemv import add_rmsnorm_gemv, cat_rmsnorm_gemv, gemv


class _Head(nn.Module):
    """Shared plumbing: draft args, RoPE tables, its own cache, target embedding (not a submodule)."""

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

    def bind(self, target) -> "_Head":
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

    def copy(self, device=None, dtype: Optional[torch.dtype] = None) -> "_Head":
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

    def program(self, cache: StaticKVCache, *, embeds_input: bool = False) -> list[Step]:
        """One draft forward as steps (segment, attention break, segment) over an env dict.

        env in:  tokens [b, t], hidden [b, t, F or hidden], positions [b, t], valid [b, t], kv_len,
                 input_embeds [b, t, hidden] (embeds_input)
        env out: out_hidden [b, t, hidden] (pre-norm: the next step's input), ids [b, t] (the greedy
                 proposal, target ids), logits [b, t, draft vocab] (unfused path only: the fused one
                 takes the argmax inside the lm_head kernel and writes no logits)
        """
        dtype = next(self.parameters()).dtype

        def start(env):
            env["attn"] = AttnInputs.build(
                env["positions"], env["valid"], self.rope_cos, self.rope_sin, cache.dummy_slot, dtype
            )
            self.pre(env, env["input_embeds"] if embeds_input else None, cache)

        def attend(env):
            env["mask"] = None if self.attention_kernel else env["attn"].mask(env["kv_len"])
            env["o"] = self.attention.attend(env["q"], cache, env["mask"], env["attn"])

        meta = self.graph_meta()
        return [
            Step("draft_pre", start, meta=meta),
            Step("draft_attn", attend, is_break=True, meta=meta),
            Step("draft_post", self.post, meta=meta),
        ]

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids; the identity for heads over the target's vocabulary."""
        return draft_ids

    def card_objective(self, f: dict) -> str:
        """The model card's training objective (heads trained with training-time test)."""
        return f"Training-time test with {f['train']['ttt_steps']} unrolled steps"

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**self.config, "architectures": [self.architecture]}, indent=2))


class Eagle3Layer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.self_attn = Attention(args, 0, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.mlp = MLP(args)


class Eagle3Head(_Head):
    architecture = "LlamaForCausalLMEagle3"

    def __init__(self, cfg: dict[str, Any], max_seq_len: int):
        super().__init__(cfg, max_seq_len)
        a = self.args
        self.n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.draft_vocab_size = cfg.get("draft_vocab_size") or a.vocab_size
        self.fc = nn.Linear(self.n_aux * cfg["target_hidden_size"], a.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(a)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if cfg.get("draft_vocab_size") is not None:  # else the target's lm_head (shares_lm_head)
            self.lm_head = nn.Linear(a.hidden_size, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(a.vocab_size) < self.draft_vocab_size)
        self.init_buffers()

    @property
    def attention(self) -> Attention:
        return self.midlayer.self_attn

    @property
    def feature_width(self) -> int:
        """Width of the target features the draft extend takes: n_aux x target hidden."""
        return self.fc.in_features

    @property
    def mlp_module(self) -> MLP:
        return self.midlayer.mlp

    def pre(self, env: dict, embeds: Optional[Tensor], cache) -> None:
        hidden, m, eps = env["hidden"], self.midlayer, self.args.rms_norm_eps
        if self.fused:  # fc, then the embedding gather, both norms and q/k/v in one kernel
            g = gemv(hidden, self.fc.weight) if hidden.shape[-1] != self.args.hidden_size else hidden  # [b, t, H]
            table, rows = self._embed_rows(env, embeds)
            qkv = cat_rmsnorm_gemv(
                table,
                g,
                m.input_layernorm.weight,
                m.hidden_norm.weight,
                eps,
                self.qkv_weight,
                self.qkv_bias,
                index1=rows,
            )  # [b, t, (heads + 2 kv) * d]
            env["g"], env["q"] = g, self._attend_fused(qkv, cache, env["attn"])
            return
        embeds = embeds if embeds is not None else self.embed(env["tokens"])  # [b, t, H]
        g = self.fc(hidden) if hidden.shape[-1] != self.args.hidden_size else hidden  # [b, t, hidden]
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(g)], dim=-1)  # [b, t, 2 * hidden]
        env["g"], env["q"] = g, m.self_attn.project(x, cache, env["attn"])

    def post(self, env: dict) -> None:
        m, eps = self.midlayer, self.args.rms_norm_eps
        if self.fused:  # o_proj; + residual, norm, gate_up, SwiGLU; down; + residual, norm, lm_head, argmax
            o = m.self_attn.o_proj
            h, act = add_rmsnorm_gemv(
                env["g"],
                gemv(env["o"], o.weight, o.bias),
                m.post_attention_layernorm.weight,
                eps,
                self.gate_up_weight,
                self.gate_up_bias,
                swiglu=True,
            )
            mlp = gemv(act, m.mlp.down_proj.weight, m.mlp.down_proj.bias)
            env["out_hidden"], env["ids"] = add_rmsnorm_gemv(
                h,
                mlp,
                self.norm.weight,
                eps,
                self.lm_head.weight,
                argmax=True,
                offsets=None if self.shares_lm_head else self.d2t,
            )  # [b, t, hidden], [b, t] target ids
            return
        h = env["g"] + m.self_attn.o_proj(env["o"])
        h = h + m.mlp(m.post_attention_layernorm(h))
        env["out_hidden"], env["logits"] = h, self.lm_head(self.norm(h))  # [b, t, hidden], [b, t, draft vocab]
        env["ids"] = self.to_target(env["logits"].argmax(-1))

    def init_from_target(self, target) -> None:
        """Training from scratch: the final norm, and the own lm_head's rows (of the draft vocabulary set
        in d2t), start as the target's: the head starts from the target's output layer."""
        with torch.no_grad():
            self.norm.weight.copy_(target.model.norm.weight)
            if not self.shares_lm_head:
                used = self.to_target(torch.arange(self.draft_vocab_size, device=self.d2t.device))  # [draft_vocab]
                self.lm_head.weight.copy_(target.lm_head.weight[used.to(target.lm_head.weight.device)])

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids if self.shares_lm_head else draft_ids + self.d2t[draft_ids]

    def card_summary(self, f: dict) -> str:
        """The model card's description (stages/train_draft.py writes the card)."""
        if self.shares_lm_head:
            tensors, vocab = (
                "`fc`, `midlayer.*`, `norm`",
                "predicting over the target's whole vocabulary through the "
                "target's lm_head.\nThe token embedding and the lm_head are the target's and are not "
                "stored here (config.json has no `draft_vocab_size`: sglang's "
                "`load_lm_head_from_target`).",
            )
        else:
            tensors, vocab = (
                "`fc`, `midlayer.*`, `norm`,\n`lm_head`, `d2t`, `t2d`",
                f"with a {f['draft_vocab_size']}-token draft vocabulary.\nThe token embedding is the "
                "target's and is not stored here.",
            )
        return (
            f"A one-layer EAGLE-3 head in the public format (`{self.architecture}`: {tensors}), reading the "
            f"target's hidden states after layers\n{f['aux_layer_ids_output_of']} (`output_of` convention), "
            f"{vocab}"
        )


class EagleHead(_Head):
    architecture = "LlamaForCausalLMEagle"

    def __init__(self, cfg: dict[str, Any], max_seq_len: int):
        super().__init__(cfg, max_seq_len)
        a = self.args
        self.fc = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=True)
        layer = nn.Module()
        layer.self_attn = Attention(a, 0)
        layer.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        layer.mlp = MLP(a)
        self.layers = nn.ModuleList([layer])
        self.init_buffers()

    @property
    def attention(self) -> Attention:
        return self.layers[0].self_attn

    @property
    def feature_width(self) -> int:
        return self.args.hidden_size  # the target's final hidden state

    @property
    def mlp_module(self) -> MLP:
        return self.layers[0].mlp

    def pre(self, env: dict, embeds: Optional[Tensor], cache) -> None:
        if self.fused:  # the embedding gather and fc in one kernel, then q/k/v
            table, rows = self._embed_rows(env, embeds)
            x = cat_rmsnorm_gemv(
                table, env["hidden"], None, None, 0.0, self.fc.weight, self.fc.bias, index1=rows, norm=False
            )  # [b, t, hidden]
            env["g"], env["q"] = x, self._attend_fused(gemv(x, self.qkv_weight, self.qkv_bias), cache, env["attn"])
            return
        embeds = embeds if embeds is not None else self.embed(env["tokens"])
        x = self.fc(torch.cat([embeds, env["hidden"]], dim=-1))  # [b, t, hidden]; no input norm in EAGLE
        env["g"], env["q"] = x, self.attention.project(x, cache, env["attn"])

    def post(self, env: dict) -> None:
        layer = self.layers[0]
        if self.fused:
            o, down = layer.self_attn.o_proj, layer.mlp.down_proj
            h, act = add_rmsnorm_gemv(
                env["g"],
                gemv(env["o"], o.weight, o.bias),
                layer.post_attention_layernorm.weight,
                self.args.rms_norm_eps,
                self.gate_up_weight,
                self.gate_up_bias,
                swiglu=True,
            )
            h = h + gemv(act, down.weight, down.bias)  # [b, t, hidden]
            env["out_hidden"], env["ids"] = h, gemv(h, self.lm_head.weight, argmax=True)  # no final norm in EAGLE
            return
        h = env["g"] + layer.self_attn.o_proj(env["o"])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        env["out_hidden"], env["logits"] = h, self.lm_head(h)
        env["ids"] = env["logits"].argmax(-1)

    def card_summary(self, f: dict) -> str:
        """The model card's description (stages/train_draft.py writes the card)."""
        return (
            f"A one-layer EAGLE head in the EAGLE reference layout (`{self.architecture}`: `fc` over the next "
            "token's embedding and the target's final hidden state, then `layers.0.*`, a decoder layer without "
            "an input norm). It predicts the next feature, which the target's lm_head reads. The token "
            "embedding and the lm_head are the target's and are not stored here."
        )


# ------------------------------------------------------------------------------------- configs
def eagle_config(target: ModelArgs) -> dict:
    """config.json of a one-layer EAGLE head of the target's shape (random init, training)."""
    return {
        "architectures": [EagleHead.architecture],
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


def eagle3_config(
    target: ModelArgs,
    aux_output_of: list[int],
    draft_vocab_size: Optional[int] = None,
    lm_head: str = "own",
    intermediate_size: Optional[int] = None,
) -> dict:
    """A public-format EAGLE3 config.json for a head matching `target` (random init, training).
    lm_head="own": its own lm_head over `draft_vocab_size` tokens (None: the target's vocabulary);
    "target": the target's lm_head, so no draft_vocab_size key (Eagle3Head.shares_lm_head).
    intermediate_size: the draft layer's MLP width (None: the target's)."""
    vocab = {} if lm_head == "target" else {"draft_vocab_size": draft_vocab_size or target.vocab_size}
    return {
        **eagle_config(target),
        "intermediate_size": intermediate_size or target.intermediate_size,
        "architectures": [Eagle3Head.architecture],
        "tie_word_embeddings": False,
        **vocab,
        "target_hidden_size": target.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_output_of), "use_aux_hidden_state": True},
    }


@dataclass(frozen=True)
class HeadCheckpoint:
    """What the plan reads from a draft checkpoint directory: config and tensor shapes, no weights."""

    path: Path
    config: dict
    shapes: dict[str, list[int]]

    @classmethod
    def read(cls, path: str, architecture: str) -> "HeadCheckpoint":
        p = Path(path).expanduser()
        if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
            raise ConfigError(
                "draft.path",
                path,
                "not a draft checkpoint (needs config.json and model.safetensors)",
                f"a {architecture} checkpoint directory, or draft.init=random",
            )
        cfg = json.loads((p / "config.json").read_text())
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch != architecture:
            raise ConfigError(
                "draft.path", path, f"architecture {arch!r} does not match the draft algorithm", architecture
            )
        try:
            shapes = safetensors_shapes(p / "model.safetensors")  # fp8 storage: each weight's scale dropped
        except ValueError as e:
            raise ConfigError(
                "draft.path",
                path,
                f"{p / 'model.safetensors'}: {e}",
                f"a complete {architecture} checkpoint (rewrite or re-download it)",
            ) from None
        return cls(p, cfg, {k: v for k, v in shapes.items() if not k.endswith(SCALE_SUFFIX)})

    def load_into(self, head: _Head) -> _Head:
        state = {
            k: v for k, v in read_state(self.path / "model.safetensors").items() if not k.startswith("embed_tokens")
        }
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(
                "draft.path",
                str(self.path),
                f"tensors do not match: missing {missing[:4]}, unexpected {unexpected[:4]}",
            )
        return head
