"""Plan-time checks shared by the weighted drafts: init mode, checkpoint fc width, vocabulary, the shape
keys of a random head (MLP width, key/value heads), which a checkpoint takes from its config.json.

Each raises one ConfigError naming the `draft.*` key, the bad value and what is valid.
"""

from __future__ import annotations

from typing import Optional

from engine.drafts.checkpoint import HeadCheckpoint
from engine.errors import ConfigError
from engine.model import ModelArgs

INITS = ("checkpoint", "random")


def check_init(cfg) -> None:
    if cfg.init not in INITS:
        raise ConfigError("draft.init", cfg.init, "unknown", INITS)
    if cfg.init == "checkpoint" and not cfg.path:
        raise ConfigError(
            "draft.path",
            cfg.path,
            f"draft.algorithm={cfg.algorithm} with draft.init=checkpoint needs a checkpoint directory",
            "a checkpoint directory, or draft.init=random",
        )


def check_fc(ckpt: HeadCheckpoint, expected: int, why: str) -> None:
    shape = ckpt.shapes.get("fc.weight")
    if shape is None:
        raise ConfigError("draft.path", str(ckpt.path), "no fc.weight in the checkpoint", "an EAGLE-family head")
    if shape[1] != expected:
        raise ConfigError(
            "draft.path",
            str(ckpt.path),
            f"fc.weight takes {shape[1]} inputs, but the target provides {expected} ({why})",
            f"a head whose fc takes {expected} inputs, or draft.aux_layer_ids with {shape[1]} // target hidden layers",
        )


def mlp_width(cfg, target: ModelArgs) -> Optional[int]:
    """draft.intermediate_size of a random head: its layers' MLP width (None: the target's)."""
    width = cfg.intermediate_size
    if width is not None and width < 1:
        raise ConfigError(
            "draft.intermediate_size",
            width,
            "the draft layers' MLP width",
            f">= 1, or null (the target's {target.intermediate_size})",
        )
    return width


def kv_heads(cfg, target: ModelArgs) -> int:
    """draft.num_kv_heads of a random head: its layers' key/value heads (null: the target's), a divisor
    of the query heads (the target's) so that they group evenly."""
    kv = cfg.num_kv_heads if cfg.num_kv_heads is not None else target.num_kv_heads
    if kv < 1 or target.num_heads % kv:
        divisors = [d for d in range(1, target.num_heads + 1) if target.num_heads % d == 0]
        raise ConfigError(
            "draft.num_kv_heads",
            kv,
            f"query heads ({target.num_heads}, the target's) are grouped over the key/value heads",
            f"a divisor of {target.num_heads}: {divisors}, or null (the target's {target.num_kv_heads})",
        )
    return kv


def reject_random_only(cfg, ckpt: HeadCheckpoint, key: str, json_key: str, what: str) -> None:
    """A random head's shape key (`draft.<key>`) set beside a checkpoint, whose config.json's `json_key`
    fixes `what`: one error naming it."""
    value = getattr(cfg, key)
    if value is not None:
        raise ConfigError(
            f"draft.{key}",
            value,
            f"a checkpoint's {what} is its config.json's ({ckpt.config.get(json_key)})",
            "null (or draft.init=random)",
        )


def reject_width(cfg, ckpt: HeadCheckpoint) -> None:
    reject_random_only(cfg, ckpt, "intermediate_size", "intermediate_size", "MLP width")


def check_target_fit(cfg_json: dict, target: ModelArgs, path) -> None:
    """A head reading the target's hidden states and vocabulary: both must be this target's."""
    th = cfg_json.get("target_hidden_size", cfg_json.get("hidden_size"))
    if th != target.hidden_size:
        raise ConfigError(
            "draft.path",
            str(path),
            f"target_hidden_size {th} differs from the target's hidden size {target.hidden_size}",
            "a head trained for this target",
        )
    check_vocab(cfg_json, target, path)


def check_vocab(cfg_json: dict, target: ModelArgs, path) -> None:
    if cfg_json.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ConfigError(
            "draft.path",
            str(path),
            f"vocab_size {cfg_json['vocab_size']} differs from the target's {target.vocab_size}",
            "a head trained for this target",
        )
