"""The decode / verify attention against SDPA and the DRAM floor: `python benchmarks/attention.py`.

For each model's attention shape (query heads, kv heads, head dim), batch size b, query tokens t (1: a
decode step, 6: a verify of k = 5) and live length L, over a static cache of `--slots` slots as the engine
allocates it (model.max_seq_len + 1):

    ours     kernels/decode_attention.py, the call the model makes (split-KV + combine)
    sdpa     torch's scaled_dot_product_attention over the live prefix alone (no mask: the same bytes)
    floor    the live K / V bytes (b x kv_heads x L x head_dim x 2) and q / out, over a measured read bandwidth

Times are per call, from CUDA-graph replays of 20 calls over rotating caches (more bytes than the L2 holds,
as a model's layers are), the median of 7 replays (benchmarks/projections.py's timing).

    python benchmarks/attention.py --models smollm2,llama3-8b --b 1,8,32,64 --t 1,6 --live 300,2000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.projections import MODELS, graph_time, read_bandwidth  # noqa: E402
from kernels.decode_attention import decode_attention  # noqa: E402

HEADER = "| model | b | t | live | ours us | SDPA us | floor us | ours / SDPA | ours / floor |"


def bench(model: str, bs, ts, lives, slots: int, bw: float, attn=decode_attention, l2_bytes: int = 200 * 2**20):
    _, _, heads, kv_heads, d, _ = MODELS[model]
    rows = []
    for b in bs:
        copies = max(2, min(64, -(-l2_bytes // (2 * b * kv_heads * slots * d * 2))))
        kvs = [  # (k, v) [b, kv_heads, slots, d]: a layer's each
            tuple(torch.randn(b, kv_heads, slots, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
            for _ in range(copies)
        ]
        for t in ts:
            for live in lives:
                floor = _floor(kvs[0][0], heads, t, live, bw)
                rows.append((model, b, t, live, *_times(attn, kvs, heads, t, live), floor))
                print(_line(rows[-1]), flush=True)
        kvs.clear()
        torch.cuda.empty_cache()
    return rows


def _times(attn, kvs, heads: int, t: int, live: int) -> tuple[float, float]:
    """(ours, SDPA) microseconds a call: t queries a row at positions live - t .. live - 1."""
    b, _, _, d = kvs[0][0].shape
    q = torch.randn(b, heads, t, d, device="cuda", dtype=torch.bfloat16)  # [b, heads, t, d]
    qpos = (live - t + torch.arange(t, device="cuda"))[None].expand(b, t).contiguous()  # [b, t]
    ours = graph_time(lambda i: attn(q, *kvs[i % len(kvs)], qpos))
    sdpa = graph_time(
        lambda i: F.scaled_dot_product_attention(
            q, kvs[i % len(kvs)][0][:, :, :live], kvs[i % len(kvs)][1][:, :, :live], enable_gqa=True
        )
    )
    return ours * 1e6, sdpa * 1e6


def _floor(k, heads: int, t: int, live: int, bw: float) -> float:
    """Microseconds to read the live K / V and q and write out, at the measured bandwidth."""
    b, kv_heads, _, d = k.shape
    return (2 * b * kv_heads * live * d + 2 * b * heads * t * d) * k.element_size() / bw * 1e6


def _line(r) -> str:
    model, b, t, live, ours, sdpa, floor = r
    return (
        f"| {model} | {b} | {t} | {live} | {ours:.1f} | {sdpa:.1f} | {floor:.1f} | {ours / sdpa:.2f} | "
        f"{ours / floor:.2f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,llama3-8b")
    ap.add_argument("--b", default="1,8,32,64", help="batch sizes")
    ap.add_argument("--t", default="1,6", help="query tokens a row (1: decode, k + 1: a verify)")
    ap.add_argument("--live", default="300,2000", help="live lengths")
    ap.add_argument("--slots", type=int, default=2049, help="cache slots (model.max_seq_len + 1)")
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    torch.manual_seed(0)
    bw = read_bandwidth()
    print(f"{torch.cuda.get_device_name()}: measured read bandwidth {bw / 1e12:.2f} TB/s, {args.slots} slots")
    print(HEADER + "\n" + "|---" * 9 + "|")
    for model in args.models.split(","):
        bench(model, ints(args.b), ints(args.t), ints(args.live), args.slots, bw)


if __name__ == "__main__":
    main()
