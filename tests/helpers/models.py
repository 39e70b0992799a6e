"""Tiny models: transformers' Llama (or Qwen3) with spread random weights beside ours with the same weights,
prompts, and the tiny target as the pipeline loads it."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from engine.loading import load_model
from engine.model import LlamaModel, ModelArgs
from helpers.runs import compose_cfg
from pipeline.config import to_run_config

TINY_CONFIG = dict(  # transformers' config keys of the tiny targets (bos/eos: the byte tokenizer's)
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


def tiny_hf_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_CONFIG, **kw})


def tiny_qwen3_config(**kw):
    """A tiny Qwen3 (q/k norms, head_dim 32 != hidden / heads, tied embeddings) from transformers' own class."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**TINY_CONFIG, "head_dim": 32, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, **kw})


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of one prompt: n tokens, no stop token (as ignore_eos)."""
    ids = torch.tensor([prompt], device=hf.device)
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


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


def tiny_gemma3_config(**kw):
    """Gemma 3 text at a tiny size: sliding layers with a window of 4 (it matters past 4 tokens) around
    a global one, a local RoPE base and a scaled global one, a query scale that is not head_dim's, a
    hidden size whose sqrt is not a round number (the embedding scale), q width != hidden."""
    from transformers import Gemma3TextConfig

    sliding, full = "sliding_attention", "full_attention"
    gemma = dict(
        hidden_size=48,
        intermediate_size=96,
        head_dim=16,
        sliding_window=4,
        layer_types=[sliding, full, sliding],
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        query_pre_attn_scalar=24,
        pad_token_id=0,
    )
    return Gemma3TextConfig(**{**TINY_CONFIG, "tie_word_embeddings": True, **gemma, **kw})


def gemma_init(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """spread_init, norm weights around 0 (Gemma's norms scale by 1 + w: w = 0 would hide a missing 1 +),
    and narrower embeddings (scaled by sqrt(hidden), at std 0.15 the tied lm_head repeats the last token)."""
    spread_init(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def gemma3_pair(max_seq_len=128, seed=0, **kw):
    """transformers' Gemma3ForCausalLM and ours with the same random weights (fp32, eager attention)."""
    from transformers import Gemma3ForCausalLM

    cfg = tiny_gemma3_config(**kw)
    cfg._attn_implementation = "eager"
    hf = gemma_init(Gemma3ForCausalLM(cfg), seed).eval()
    ours = LlamaModel(ModelArgs.from_hf_config(cfg.to_dict()), max_seq_len)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf, ours.eval()


def save_tiny_gemma3(path, seed: int = 0, **kw):
    """A tiny Gemma 3 checkpoint directory as a user brings one: save_pretrained's weights and config,
    and the byte tokenizer (save_byte_tokenizer). Returns transformers' model."""
    from transformers import Gemma3ForCausalLM

    hf = gemma_init(Gemma3ForCausalLM(tiny_gemma3_config(**kw)), seed).eval()
    hf.save_pretrained(path)
    save_byte_tokenizer(path)
    return hf


def save_byte_tokenizer(path) -> None:
    """A character-level tokenizer (ids = byte values, <s> 256, </s> 257) with a chat template of
    ByteTokenizer's shape, saved as a checkpoint directory's tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in [10, *range(32, 127)]} | {"<unk>": 0, "<s>": 256, "</s>": 257}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=template
    ).save_pretrained(path)
