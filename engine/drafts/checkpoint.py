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

from engine.drafts.storage import SCALE_SUFFIX, read_state, safetensors_shapes
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
