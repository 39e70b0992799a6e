"""Reading a draft checkpoint directory (config.json + model.safetensors), generic over the algorithms.

    HeadCheckpoint.read(path, architecture)   config and tensor shapes only (the plan: no weights)
    checkpoint.load_into(head)                the weights, bf16 or fp8 storage (engine/drafts/storage.py)

Writing is the head's `save` (engine/drafts/common/head.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from engine.drafts.storage import SCALE_SUFFIX, read_state, safetensors_header
from engine.errors import ConfigError


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
            header = safetensors_header(p / "model.safetensors")
        except ValueError as e:
            raise ConfigError(
                "draft.path",
                path,
                f"{p / 'model.safetensors'}: {e}",
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
        return cls(p, cfg, shapes)

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
