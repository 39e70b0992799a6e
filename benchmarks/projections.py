"""The decode / verify projections against cuBLAS and the DRAM floor: `python benchmarks/projections.py`.

For each projection of a model's layer (as the fused path calls it: norm + qkv, o, norm + gate_up + SwiGLU,
down, norm + lm_head with the greedy argmax, and its logits) at each row count M, on random weights of
the model's exact shapes:

    ours     kernels/gemv.py, the call the model makes
    cublas   torch.nn.functional.linear on the same x and w (the bare product: no norm, no epilogue)
    floor    the bytes the call must move (weight + activations in + outputs) over a measured read bandwidth

Times are per call, from CUDA-graph replays of 20 calls over rotating weight copies (more bytes than the L2
holds, as a model's layers are), the median of 7 replays. Also checked: every row of M rows bitwise equal to
the same row computed alone (batch invariance). Writes a Markdown table to --out (default: stdout only).

    python benchmarks/projections.py --models smollm2,llama3-8b,qwen3-8b --m 1,6,48,192,256
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.gemv import add_rmsnorm_gemv, gemv, row_tile  # noqa: E402
from kernels.runtime import set_pdl  # noqa: E402

# hidden, intermediate, heads, kv heads, head dim, vocab (the public configs)
MODELS = {
    "smollm2": (576, 1536, 9, 3, 64, 49152),
    "llama3-8b": (4096, 14336, 32, 8, 128, 128256),
    "qwen3-8b": (4096, 12288, 32, 8, 128, 151936),
}


@dataclass
class Projection:
    name: str
    n: int
    k: int
    kind: str  # "norm" (delta + rmsnorm prologue), "plain", "swiglu", "argmax", "logits"

    def call(self, x, w, delta, norm_w):
        if self.kind == "plain":
            return gemv(x, w)
        glu, argmax = "silu" if self.kind == "swiglu" else None, self.kind == "argmax"
        d = None if self.kind == "logits" else delta
        return add_rmsnorm_gemv(x, d, norm_w, 1e-5, w, glu=glu, argmax=argmax)[1]

    def bytes(self, m: int) -> int:
        out = {"swiglu": self.n // 2, "argmax": 0}.get(self.kind, self.n) * m * 2
        acts = m * self.k * 2 * (2 if self.kind in ("norm", "swiglu", "argmax") else 1)
        return self.n * self.k * 2 + acts + out


def projections(model: str) -> list[Projection]:
    h, inter, heads, kv, d, vocab = MODELS[model]
    return [
        Projection("qkv", (heads + 2 * kv) * d, h, "norm"),
        Projection("o", h, heads * d, "plain"),
        Projection("gate_up", 2 * inter, h, "swiglu"),
        Projection("down", h, inter, "plain"),
        Projection("lm_head", vocab, h, "argmax"),
        Projection("lm_head.logits", vocab, h, "logits"),
    ]


def graph_time(fn, calls: int = 20, reps: int = 7) -> float:
    """Seconds per call: a CUDA graph of `calls` calls (fn(i) for i in range(calls)), replayed reps times."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def read_bandwidth() -> float:
    """Bytes/s of a 4 GiB read (a sum: one read per byte, a negligible write)."""
    t = torch.randn(2**31, device="cuda", dtype=torch.bfloat16)
    sec = graph_time(lambda i: torch.sum(t, dtype=torch.float32), calls=5, reps=5)
    return t.numel() * 2 / sec


def invariant(p: Projection, w, norm_w, m: int) -> bool:
    """Every row of an M-row call bitwise equal to that row alone."""
    x = torch.randn(m, p.k, device="cuda", dtype=torch.bfloat16)
    delta = torch.randn_like(x)
    batch = p.call(x, w, delta, norm_w)
    return all(torch.equal(batch[i : i + 1], p.call(x[i : i + 1], w, delta[i : i + 1], norm_w)) for i in range(m))


def bench(model: str, ms: list[int], bw: float, l2_bytes: int = 200 * 2**20) -> list[dict]:
    rows = []
    for p in projections(model):
        copies = max(2, min(32, -(-l2_bytes // (p.n * p.k * 2))))
        ws = [torch.randn(p.n, p.k, device="cuda", dtype=torch.bfloat16) / p.k**0.5 for _ in range(copies)]
        norm_w = torch.rand(p.k, device="cuda", dtype=torch.bfloat16) + 0.5
        for m in ms:
            x = torch.randn(m, p.k, device="cuda", dtype=torch.bfloat16)
            delta = torch.randn_like(x)
            ours = graph_time(lambda i, p=p, x=x, d=delta, ws=ws, nw=norm_w: p.call(x, ws[i % len(ws)], d, nw))
            cublas = graph_time(lambda i, x=x, ws=ws: F.linear(x, ws[i % len(ws)]))
            floor = p.bytes(m) / bw
            rows.append(
                {
                    "model": model,
                    "proj": p.name,
                    "N x K": f"{p.n}x{p.k}",
                    "M": m,
                    "rows": row_tile(m, p.n),
                    "ours_us": ours * 1e6,
                    "cublas_us": cublas * 1e6,
                    "floor_us": floor * 1e6,
                    "vs_cublas": ours / cublas,
                    "vs_floor": ours / floor,
                    "invariant": invariant(p, ws[0], norm_w, m) if m > 1 else True,
                }
            )
            print(_line(rows[-1]), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    return rows


HEADER = (
    "| model | projection | N x K | M | ours us | cuBLAS us | floor us | ours / cuBLAS | ours / floor | invariant |"
)


def _line(r: dict) -> str:
    return (
        f"| {r['model']} | {r['proj']} | {r['N x K']} | {r['M']} | {r['ours_us']:.1f} | {r['cublas_us']:.1f} | "
        f"{r['floor_us']:.1f} | {r['vs_cublas']:.2f} | {r['vs_floor']:.2f} | {'yes' if r['invariant'] else 'NO'} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,llama3-8b,qwen3-8b")
    ap.add_argument("--m", default="1,6,48,192,256", help="row counts")
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    ap.add_argument("--pdl", action="store_true", help="our kernels with programmatic dependent launch (model.pdl)")
    args = ap.parse_args()
    set_pdl(args.pdl)
    torch.manual_seed(0)
    bw = read_bandwidth()
    print(f"{torch.cuda.get_device_name()}: measured read bandwidth {bw / 1e12:.2f} TB/s, pdl {args.pdl}")
    print(HEADER + "\n" + "|---" * 10 + "|")
    rows = []
    for model in args.models.split(","):
        rows += bench(model, [int(m) for m in args.m.split(",")], bw)
    worst = max(rows, key=lambda r: r["vs_cublas"])
    print(
        f"worst ours / cuBLAS: {worst['vs_cublas']:.2f} ({worst['model']} {worst['proj']} M={worst['M']}); "
        f"invariant everywhere: {all(r['invariant'] for r in rows)}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join([HEADER, "|---" * 10 + "|"] + [_line(r) for r in rows]) + "\n")


if __name__ == "__main__":
    main()
