"""Reading a draft checkpoint directory (config.json + model.safetensors, or the pytorch_model.bin of the
EAGLE authors' releases), generic over the algorithms.

    HeadCheckpoint.read(path, architecture)   config and tensor shapes only (the plan: no weights)
    checkpoint.load_into(head)                the weights, bf16 or fp8 storage (engine/drafts/storage.py)

Writing is the head's `save` (engine/drafts/common/head.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.drafts.storage import SCALE_SUFFIX, read_state, safetensors_header
from engine.errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the first one present is read


def _pickled(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin's tensors, memory-mapped (the plan reads shapes only) and unpickled safely."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError("not a state dict of tensors")
    return state


@dataclass(frozen=True)
class HeadCheckpoint:
    """What the plan reads from a draft checkpoint directory: config and tensor shapes, no weights."""

    path: Path
    config: dict
    shapes: dict[str, list[int]]
    weights: str = WEIGHT_FILES[0]  # the file the tensors are read from

    @classmethod
    def read(cls, path: str, architecture: str) -> "HeadCheckpoint":
        p = Path(path).expanduser()
        weights = next((f for f in WEIGHT_FILES if (p / f).is_file()), None)
        if not (p / "config.json").is_file() or weights is None:
            raise ConfigError(
                "draft.path",
                path,
                f"not a draft checkpoint (needs config.json and {' or '.join(WEIGHT_FILES)})",
                f"a {architecture} checkpoint directory, or draft.init=random",
            )
        try:
            cfg = json.loads((p / "config.json").read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(
                "draft.path", path, f"config.json is not JSON ({e})", "a checkpoint's config.json"
            ) from None
        if not isinstance(cfg, dict):
            raise ConfigError(
                "draft.path",
                path,
                f"config.json holds a {type(cfg).__name__}, not an object",
                "a checkpoint's config.json",
            )
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch != architecture:
            raise ConfigError(
                "draft.path", path, f"architecture {arch!r} does not match the draft algorithm", architecture
            )
        try:
            if weights == "model.safetensors":
                header = safetensors_header(p / weights)
            else:
                header = {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in _pickled(p / weights).items()}
        except (ValueError, RuntimeError, EOFError, OSError) as e:  # truncated, or not this kind of file
            raise ConfigError(
                "draft.path",
                path,
                f"{p / weights}: {e}",
                f"a complete {architecture} checkpoint (rewrite or re-download it)",
            ) from None
        unscaled = [k for k, v in header.items() if v["dtype"].startswith("F8") and k + SCALE_SUFFIX not in header]
        if unscaled:  # loaded raw, an fp8 weight is off by its scale: the head drafts nothing useful
            raise ConfigError(
                "draft.path",
                path,
                f"fp8 weights without their {SCALE_SUFFIX} tensor: {unscaled[:4]}",
                f"a complete {architecture} checkpoint (rewrite or re-download it)",
            )
        shapes = {k: v["shape"] for k, v in header.items() if not k.endswith(SCALE_SUFFIX)}  # scales dropped
        return cls(p, cfg, shapes, weights)

    def tensor_problems(self, head: nn.Module) -> list[str]:
        """How the checkpoint's tensors differ from those `head` loads (names and shapes) -> one line each."""
        mine = {k: list(v.shape) for k, v in head.state_dict().items() if not k.startswith("embed_tokens")}
        theirs = {k: v for k, v in self.shapes.items() if not k.startswith("embed_tokens")}
        out = [f"missing {k} {mine[k]}" for k in sorted(mine.keys() - theirs.keys())]
        out += [f"unexpected {k} {theirs[k]}" for k in sorted(theirs.keys() - mine.keys())]
        out += [
            f"{k} is {theirs[k]}, expected {mine[k]}"
            for k in sorted(mine.keys() & theirs.keys())
            if mine[k] != theirs[k]
        ]
        return out

    def load_into(self, head: nn.Module) -> nn.Module:
        path = self.path / self.weights
        state = read_state(path) if self.weights == "model.safetensors" else _pickled(path)
        state = {k: v for k, v in state.items() if not k.startswith("embed_tokens")}
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(
                "draft.path",
                str(self.path),
                f"tensors do not match: missing {missing[:4]}, unexpected {unexpected[:4]}",
            )
        return head
