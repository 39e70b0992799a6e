"""Tiny models: transformers' Llama (or Qwen3) with spread random weights beside ours with the same weights,
prompts, and the tiny target as the pipeline loads it."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from engine.loading import load_model
from engine.model import LlamaModel, ModelArgs
from helpers.runs import compose_cfg
from pipeline.config import to_run_config


def tiny_hf_config(**kw):
    from transformers import LlamaConfig

    base = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        bos_token_id=256,
        eos_token_id=257,
    )
    base.update(kw)
    return LlamaConfig(**base)


def tiny_qwen3_config(**kw):
    """A tiny Qwen3 (q/k norms, head_dim 32 != hidden / heads, tied embeddings) from transformers' own class."""
    from transformers import Qwen3Config

    base = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        bos_token_id=256,
        eos_token_id=257,
    )
    base.update(kw)
    return Qwen3Config(**base)


def spread_init(model: torch.nn.Module, seed: int = 0, std: float = 0.15, norms: float = 0.0) -> torch.nn.Module:
    """Weights wide enough that greedy outputs vary from token to token (std 0.02 collapses to one token);
    norms > 0: the norm weights too, 1 + norms * N(0, 1) (so a q/k norm that is skipped shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, p in model.named_parameters():
            if "norm" in name and norms:
                p.copy_(1 + torch.randn(p.shape, generator=g) * norms)
    return model


def pair(hf_cls=LlamaForCausalLM, hf_cfg=None, max_seq_len=128, seed=0, norms: float = 0.0):
    hf_cfg = hf_cfg or tiny_hf_config()
    hf = spread_init(hf_cls(hf_cfg), seed, norms=norms).eval()
    ours = LlamaModel(ModelArgs.from_hf_config(hf_cfg.to_dict()), max_seq_len)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if ours.args.tie_word_embeddings:
        assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    return hf, ours.eval()


def random_prompts(n, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def qwen3_pair(max_seq_len=128, **kw):
    """transformers' Qwen3ForCausalLM and ours with the same random weights, q/k norm weights spread."""
    from transformers import Qwen3ForCausalLM

    return pair(Qwen3ForCausalLM, tiny_qwen3_config(**kw), max_seq_len, norms=0.3)


def tiny_target(outputs, device: str = "cpu", dtype=torch.float32):
    cfg = to_run_config(compose_cfg("model=tiny", f"device={device}"))
    return load_model(cfg.model, outputs / "weights", torch.device(device), dtype)


def synth(target, batch_size: int, **kw):
    """`synthesize` over a plain (eager) Generator of `batch_size` rows."""
    from engine.speculative.generate import Generator
    from engine.train.selfdistill import synthesize

    return synthesize(target, Generator(target.model, batch_size), **kw)
