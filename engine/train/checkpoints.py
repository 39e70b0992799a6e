"""Training checkpoints that survive a kill at any point: written aside, sealed, then swapped in.

    write(out_dir, step, fill)      fill(tmp) writes the files; they are fsynced and sealed with a
                                    manifest (`complete.json`: step, each file's size), then the folder
                                    replaces `checkpoint/` (the previous one renamed to `checkpoint.old`
                                    first and removed last)
    newest(out_dir) -> Path | None  the complete checkpoint of the highest step among checkpoint/,
                                    checkpoint.tmp/ and checkpoint.old/ (a kill between the renames leaves
                                    the new one under .tmp), moved to checkpoint/; incomplete ones named
    mismatch(ckpt, head) -> str     the config keys and tensors in which a checkpoint differs from a head

Invariant: at every instant one complete checkpoint of the last save (or of the one before) is on disk.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

MANIFEST = "complete.json"
NAMES = ("checkpoint", "checkpoint.tmp", "checkpoint.old")  # in the order of a save's renames


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_in(src: Path, out_dir: Path) -> Path:
    """`src` becomes out_dir/checkpoint; the one there goes aside first and is removed last."""
    ckpt, old = out_dir / NAMES[0], out_dir / NAMES[2]
    shutil.rmtree(old, ignore_errors=True)
    if ckpt.exists():
        os.rename(ckpt, old)
    os.rename(src, ckpt)
    _fsync(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return ckpt


def write(out_dir: Path, step: int, fill: Callable[[Path], None]) -> Path:
    tmp = out_dir / NAMES[1]
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    sizes = {}
    for f in sorted(tmp.iterdir()):
        _fsync(f)
        sizes[f.name] = f.stat().st_size
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": sizes}))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    return _swap_in(tmp, out_dir)


def _sealed_step(path: Path) -> Optional[int]:
    """The step of a complete checkpoint (its manifest there and every file of its size), else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if all((path / name).stat().st_size == size for name, size in manifest["files"].items()):
            return int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def newest(out_dir: Path) -> Optional[Path]:
    found = {name: _sealed_step(out_dir / name) for name in NAMES if (out_dir / name).exists()}
    complete = {name: step for name, step in found.items() if step is not None}
    for name in found.keys() - complete.keys():
        print(f"[train_draft] {out_dir / name} is incomplete (a save cut short): not resumed from", flush=True)
    if not complete:
        return None
    best = max(complete, key=lambda n: (complete[n], -NAMES.index(n)))
    if best == NAMES[0]:
        for name in NAMES[1:]:
            shutil.rmtree(out_dir / name, ignore_errors=True)
        return out_dir / best
    staged = out_dir / NAMES[1]
    if best != NAMES[1]:  # checkpoint.old: the only complete one (checkpoint/ gone, .tmp cut short)
        shutil.rmtree(staged, ignore_errors=True)
        os.rename(out_dir / best, staged)
    return _swap_in(staged, out_dir)


def mismatch(config: dict, shapes: dict[str, list[int]], head) -> str:
    """How a checkpoint (config.json, tensor shapes) differs from `head` ("" when it does not)."""
    own = json.loads(json.dumps({**head.config, "architectures": [head.architecture]}))  # as saved
    keys = sorted(k for k in own.keys() | config.keys() if own.get(k) != config.get(k))
    mine = {k: list(v.shape) for k, v in head.state_dict().items()}
    tensors = sorted(k for k in mine.keys() | shapes.keys() if mine.get(k) != shapes.get(k))
    parts = [f"{k}: checkpoint {config.get(k)!r}, this run {own.get(k)!r}" for k in keys]
    parts += [f"tensor {k}: checkpoint {shapes.get(k)}, this run {mine.get(k)}" for k in tensors[:8]]
    return "; ".join(parts)
