"""MTP layers shipped inside a target's checkpoint, read as the modules of a MultiLayerEagleHead.

`draft.path` may be the target's own checkpoint directory when its config.json declares
`num_nextn_predict_layers` and its safetensors (one file or shards) carry the layers in one of the public
layouts below. Names are mapped once, by a table per layout; the modules' decoder layers keep their names
(`self_attn.q_proj.weight`, ...). Module i (0-based) of the source becomes our `layers.{i}`:

    mimo      XiaomiMiMo/MiMo-7B (MiMoForCausalLM, Qwen2 layers with q/k/v biases; sglang and vLLM
              mimo_mtp.py): model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj,
              final_layernorm}.weight -> enorm, hnorm, eh_proj, shared_head.norm. input_proj [H, 2H] reads
              cat(hidden, token), eh_proj cat(token, hidden): its column halves swap.
    deepseek  DeepSeek-V3 nextn (sglang deepseek_nextn.py, vLLM deepseek_mtp.py): model.layers.{N + i}.
              {enorm, hnorm, eh_proj, shared_head.norm}.weight under the same names, N = num_hidden_layers;
              its embed_tokens and shared_head.head are copies of the target's and are not read.

Only the shapes are read at plan time (safetensors headers); `load_into` reads the modules' tensors. The
head's config sets ZERO_EMBED_AT_0: these layers were trained on a zero token embedding at position 0
(vLLM's deepseek_mtp.py and mimo_mtp.py, sglang's mimo_mtp.py zero it before enorm).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from torch import nn

from engine.drafts.multi_layer.head import ZERO_EMBED_AT_0
from engine.drafts.storage import safetensors_header
from engine.errors import ConfigError
from engine.model import ModelArgs

LAYER_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "mimo": "qwen2"}


@dataclass(frozen=True)
class MTPLayout:
    """Where module i's tensors sit in a target checkpoint and how their names map to ours."""

    prefix: str  # module i's prefix; {i}: the module, {n}: the target's num_hidden_layers
    names: dict[str, str]  # their name after the prefix -> ours after `layers.{i}.` (others: the same)
    shared: tuple[str, ...] = ()  # their copies of the target's tensors (after the prefix): not read
    swapped: tuple[str, ...] = ()  # our weights whose two column halves are in the other order

    def module_prefix(self, i: int, n: int) -> str:
        return self.prefix.format(i=i, n=n + i)


LAYOUTS = {
    "mimo": MTPLayout(
        "model.mtp_layers.{i}.",
        {
            "token_layernorm.weight": "enorm.weight",
            "hidden_layernorm.weight": "hnorm.weight",
            "input_proj.weight": "eh_proj.weight",
            "final_layernorm.weight": "shared_head.norm.weight",
        },
        swapped=("eh_proj.weight",),
    ),
    "deepseek": MTPLayout("model.layers.{n}.", {}, shared=("embed_tokens.weight", "shared_head.head.weight")),
}


def declares_mtp(path: str, head_architecture: str) -> bool:
    """A target's checkpoint directory whose config.json declares MTP layers (not a head of ours, whose
    config.json counts its modules under the same key)."""
    try:
        cfg = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False  # HeadCheckpoint.read reports it
    if not isinstance(cfg, dict) or not cfg.get("num_nextn_predict_layers"):
        return False
    return (cfg.get("architectures") or [None])[0] != head_architecture


@dataclass(frozen=True)
class TargetMTPCheckpoint:
    """A target checkpoint's MTP layers, as HeadCheckpoint: `config` is the head's, `shapes` in our names."""

    path: Path
    config: dict
    shapes: dict[str, list[int]]
    layout: str
    sources: dict[str, tuple[Path, str]]  # our name -> (file, their name)

    @classmethod
    def read(cls, path: str, target: ModelArgs, head_config) -> "TargetMTPCheckpoint":
        """config.json and the safetensors headers; the module count, widths and vocabulary checked against
        `target`. head_config(args, n): the head's config.json for n modules of `args`' shape."""
        p = Path(path).expanduser()
        cfg = json.loads((p / "config.json").read_text())
        n = int(cfg["num_nextn_predict_layers"])
        files = sorted(p.glob("*.safetensors"))
        header: dict[str, tuple[Path, list[int]]] = {}
        for f in files:
            try:
                header.update({k: (f, v["shape"]) for k, v in safetensors_header(f).items()})
            except (ValueError, OSError) as e:
                raise ConfigError("draft.path", path, f"{f}: {e}", "a complete checkpoint") from None
        layers = cfg.get("num_hidden_layers", 0)
        modules: dict[str, dict[int, list[str]]] = {}  # layout -> module index -> its tensors' names
        for name in header:
            if (found := mtp_module(name, layers)) is not None:
                modules.setdefault(found[0], {}).setdefault(found[1], []).append(name)
        if len(modules) != 1:
            where = " or ".join(f"{lay.module_prefix(0, layers)}* ({k})" for k, lay in LAYOUTS.items())
            raise ConfigError(
                "draft.path",
                path,
                f"config.json declares num_nextn_predict_layers={n}; its MTP tensors are in the layouts "
                f"{sorted(modules)}",
                f"a checkpoint with its MTP layers in one layout: {where}",
            )
        ((layout, held),) = modules.items()
        lay = LAYOUTS[layout]
        if sorted(held) != list(range(n)):
            raise ConfigError(
                "draft.path",
                path,
                f"config.json declares num_nextn_predict_layers={n}; its tensors hold modules {sorted(held)}",
                f"tensors for modules 0..{n - 1}, one per MTP layer",
            )
        model_type = LAYER_MODEL_TYPES.get(cfg.get("model_type"))
        if model_type is None:
            raise ConfigError(
                "draft.path",
                path,
                f"its MTP layers are {cfg.get('model_type')!r} decoder layers",
                f"a checkpoint of model_type {sorted(LAYER_MODEL_TYPES)}",
            )
        for key, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
            if cfg.get(key) != want:
                raise ConfigError(
                    "draft.path", path, f"{key} {cfg.get(key)} differs from the target's {want}", "this target's MTP"
                )
        shapes, sources = {}, {}
        for i, names in held.items():
            prefix = lay.module_prefix(i, layers)
            for name in names:
                (f, shape), rest = header[name], name[len(prefix) :]
                if rest in lay.shared:
                    if shape != [target.vocab_size, target.hidden_size]:
                        raise ConfigError(
                            "draft.path",
                            path,
                            f"{name} is {shape}, the target's embedding is {[target.vocab_size, target.hidden_size]}",
                            "this target's MTP",
                        )
                    continue
                ours = f"layers.{i}.{lay.names.get(rest, rest)}"
                shapes[ours], sources[ours] = shape, (f, name)
        args = ModelArgs.from_hf_config({**cfg, "model_type": model_type})
        config = {**head_config(args, n), "model_type": model_type, ZERO_EMBED_AT_0: True}  # as vLLM, sglang run them
        return cls(p, config, shapes, layout, sources)

    def tensor_problems(self, head: nn.Module) -> list[str]:
        mine = {k: list(v.shape) for k, v in head.state_dict().items()}
        out = [f"missing {k} {mine[k]}" for k in sorted(mine.keys() - self.shapes.keys())]
        out += [f"unexpected {k} {self.shapes[k]}" for k in sorted(self.shapes.keys() - mine.keys())]
        return out + [f"{k} is {self.shapes[k]}, expected {v}" for k, v in mine.items() if self.shapes.get(k, v) != v]

    def load_into(self, head: nn.Module) -> nn.Module:
        """The modules' tensors, renamed; a swapped weight's column halves exchanged."""
        state: dict[str, torch.Tensor] = {}
        for f in sorted({f for f, _ in self.sources.values()}):
            with safe_open(str(f), framework="pt") as sf:
                for ours, (src, theirs) in self.sources.items():
                    if src == f:
                        state[ours] = _swap_halves(sf.get_tensor(theirs), ours, LAYOUTS[self.layout].swapped)
        head.load_state_dict(state, strict=True)
        return head


def _swap_halves(w: torch.Tensor, name: str, swapped: tuple[str, ...]) -> torch.Tensor:
    """[H, 2H] cat(a, b) columns -> cat(b, a) for the weights in `swapped`."""
    if not any(name.endswith(s) for s in swapped):
        return w
    h = w.shape[1] // 2
    return torch.cat([w[:, h:], w[:, :h]], dim=1)


def mtp_module(name: str, num_layers: int) -> Optional[tuple[str, int]]:
    """(layout, module index) of a target checkpoint's tensor that belongs to an MTP layer, else None (a
    target of num_layers layers loads the rest and skips these)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "model" or not parts[2].isdigit():
        return None
    if parts[1] == "mtp_layers":
        return "mimo", int(parts[2])
    if parts[1] == "layers" and int(parts[2]) >= num_layers:
        return "deepseek", int(parts[2]) - num_layers
    return None
