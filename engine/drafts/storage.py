"""How a draft head's weights are stored: bf16 (the public layout), or fp8 with per-channel scales.

A shipped head travels with every clone, so its file is kept small. fp8 storage halves a bf16 file:

    <name>.weight        [out, in] float8_e4m3fn   weight / scale, rounded
    <name>.weight_scale  [out]     float32         per output channel: max |weight| / 448 (e4m3's largest)

Only 2-D weights of at least `MIN_ELEMENTS` are stored this way (the projections, fc, lm_head); norms,
the draft-vocabulary maps (d2t, t2d) and small tensors stay as they are. Loading multiplies back into
float32 and the head then casts to the compute dtype: `dequantize` is the inverse the loader applies
whenever `weight_scale` tensors are present, so a checkpoint in either form loads the same way.

    python -m engine.drafts.storage SRC DST --dtype bf16|fp8

writes a checkpoint directory (config.json, model.safetensors, and the README.md / training.json beside
them) in the chosen form: bf16 for tools that read the public layout (sglang, SpecForge, z-lab's DFlash),
fp8 for shipping.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
MIN_ELEMENTS = 1 << 12  # smaller matrices are not worth a scale vector
SCALE_SUFFIX = "_scale"  # "<name>.weight" -> "<name>.weight_scale" (vLLM's per-channel fp8 naming)
STORAGE = ("bf16", "fp8")


def _quantizable(name: str, t: Tensor) -> bool:
    return name.endswith("weight") and t.is_floating_point() and t.dim() == 2 and t.numel() >= MIN_ELEMENTS


def quantize(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """bf16/fp32 state -> fp8 weights [out, in] with float32 scales [out]; other tensors unchanged."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if not _quantizable(name, t):
            out[name] = t
            continue
        w = t.float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
        out[name] = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out[name + SCALE_SUFFIX] = scale
    return out


def dequantize(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of `quantize`: every fp8 weight with a scale, back to float32 (no-op without scales)."""
    out = {k: v for k, v in state.items() if not k.endswith(SCALE_SUFFIX)}
    for name, scale in state.items():
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            out[base] = state[base].float() * scale.float()[:, None]
    return out


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header (`safetensors_header`)."""
    return {k: v["shape"] for k, v in safetensors_header(path).items()}


def safetensors_header(path: Path) -> dict[str, dict]:
    """Each tensor's `dtype` and `shape` from a safetensors header, reading no weights; ValueError when
    the file is not a whole safetensors file (the header's length past the end, a header that is not
    JSON, tensor data past the end: a truncated download), so nothing allocates what a broken length
    claims."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise ValueError(f"{size} bytes: too short for a safetensors header")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise ValueError(f"its header claims {n} bytes but the file has {size}: truncated, or not safetensors")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"its header is not JSON ({e}): not a safetensors file") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object: not a safetensors file")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
        out = {k: {"dtype": str(v["dtype"]), "shape": [int(x) for x in v["shape"]]} for k, v in tensors.items()}
    except (KeyError, IndexError, TypeError, ValueError):
        raise ValueError("its header does not describe tensors (dtype, shape, data_offsets)") from None
    if 8 + n + end > size:
        raise ValueError(f"its tensors end at byte {8 + n + end} but the file has {size}: truncated")
    return out


def read_state(path: Path) -> dict[str, Tensor]:
    """A checkpoint's tensors in a loadable form (fp8 weights dequantized)."""
    with safe_open(str(path), framework="pt") as f:
        return dequantize({k: f.get_tensor(k) for k in f.keys()})


def write_checkpoint(src: Path, dst: Path, storage: str) -> Path:
    """SRC's checkpoint directory rewritten into DST with its weights stored as `storage`."""
    if storage not in STORAGE:
        raise ValueError(f"storage {storage!r}: one of {STORAGE}")
    state = read_state(src / "model.safetensors")
    floats = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()}
    stored = quantize(floats) if storage == "fp8" else floats
    dst.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in stored.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt", "storage": storage},
    )
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("README.md", "training.json"):
        if (src / extra).is_file() and src.resolve() != dst.resolve():
            shutil.copy(src / extra, dst / extra)
    return dst / "model.safetensors"


def main() -> None:
    ap = argparse.ArgumentParser(description="Rewrite a draft checkpoint with bf16 or fp8 (per-channel) weights.")
    ap.add_argument("src", type=Path, help="checkpoint directory (config.json + model.safetensors)")
    ap.add_argument("dst", type=Path, help="output directory (may be SRC)")
    ap.add_argument("--dtype", choices=STORAGE, default="bf16")
    a = ap.parse_args()
    written = write_checkpoint(a.src, a.dst, a.dtype)
    print(f"{written} ({a.dtype}): {written.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
