"""The target's prefill against the bare cuBLAS + SDPA chain: `python benchmarks/prefill.py [overrides...]`.

Composes the pipeline config as `python -m pipeline` does (e.g. `model=llama3_8b_shape`: random weights
at Llama-3.1-8B's shapes, drawn on the GPU), loads the target, and times one prompt of each length
(--tokens, default 1K / 8K / 32K) through the forward the engine's prefill runs (fused path, causal SDPA
over fresh rows, logits at the last position), against the same shapes as bare calls: F.linear for the
projections (q/k/v as one weight, gate/up as one), causal SDPA, SiLU * up, and the last position's
lm_head. CUDA events around each call, the median of 5 after a warm-up. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from engine.loading import load_model
from pipeline.config import register_configs, to_run_config
from pipeline.paths import REPO, outputs_dir


def cuda_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def prefill(model, cache, t: int):
    """One t-token prompt through the forward the engine's prefill runs (generate.py `Generator.prefill`)."""
    dev = model.lm_head.weight.device
    tokens = torch.randint(0, model.args.vocab_size, (1, t), device=dev)  # [1, t]
    positions = torch.arange(t, device=dev)[None]  # [1, t]
    last = torch.tensor([t - 1], device=dev)
    return lambda: model(tokens, positions, cache, kv_len=t, logits_index=last, causal=True)


def bare_chain(model, t: int):
    """The prefill's matmuls and attention as bare torch calls on the model's own weights."""
    a, dev = model.args, model.lm_head.weight.device
    x = torch.randn(1, t, a.hidden_size, device=dev, dtype=model.lm_head.weight.dtype)  # [1, t, hidden]
    q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    weights = []
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        weights.append((qkv, att.o_proj.weight, gate_up, mlp.down_proj.weight))

    def heads(y, n):  # [1, t, n * d] -> [1, n, t, d]
        return y.view(1, t, n, a.head_dim).transpose(1, 2)

    def run():
        for qkv, o, gate_up, down in weights:
            q, k, v = F.linear(x, qkv).split([q_dim, kv_dim, kv_dim], dim=-1)
            q, k, v = heads(q, a.num_heads), heads(k, a.num_kv_heads), heads(v, a.num_kv_heads)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = F.linear(att.transpose(1, 2).reshape(1, t, q_dim), o)
            g, u = F.linear(h, gate_up).chunk(2, dim=-1)
            F.linear(F.silu(g) * u, down)
        F.linear(x[:, -1:], model.lm_head.weight)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,8192,32768", help="prompt lengths, comma-separated")
    ap.add_argument("overrides", nargs="*", help="pipeline overrides, e.g. model=llama3_8b_shape")
    args = ap.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        overrides = ["tracking=off", f"model.max_seq_len={max(lengths)}", *args.overrides]
        cfg = to_run_config(compose(config_name="config", overrides=overrides))
    dev = torch.device("cuda")
    model = load_model(cfg.model, outputs_dir() / "weights", dev, torch.bfloat16).model
    cache = model.new_cache(1)
    print(f"{cfg.model.name}, {torch.cuda.get_device_name(dev)}\n")
    print("| prompt tokens | ours ms | cuBLAS + SDPA ms | ours / bare |\n| ---: | ---: | ---: | ---: |")
    for t in lengths:
        with torch.no_grad():
            ours = cuda_ms(prefill(model, cache, t))
            bare = cuda_ms(bare_chain(model, t))
        print(f"| {t} | {ours:.1f} | {bare:.1f} | {ours / bare:.2f} |", flush=True)


if __name__ == "__main__":
    main()
