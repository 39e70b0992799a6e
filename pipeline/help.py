"""`python -m pipeline --help`, and the key reference docs/configuration.md, both read from the sources.

    help_text()       what the tool is, the config groups (one line each, their options from conf/),
                      the experiments (each file's first sentence), where the key reference is
    key_reference()   docs/configuration.md: every key of the run schema (schema/, each draft algorithm's
                      own: engine/drafts) with its default and the comments written at its field, group by group

`python -m pipeline.help --write` regenerates docs/configuration.md; a test keeps it current.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from enum import Enum
from pathlib import Path

import schema
from engine.drafts.config import NoDraft
from pipeline.paths import REPO

CONF = REPO / "conf"
REFERENCE = REPO / "docs" / "configuration.md"
GROUPS = {  # config group -> what it chooses (its options are the files in conf/<group>/)
    "model": "the target model: where its weights come from, its KV cache length, its kernels",
    "draft": "the draft algorithm and its head (draft.num_steps: k tokens proposed per verify)",
    "graph": "the CUDA graph policy of the target and of the draft (debug: the CPU stand-in)",
    "eval": "the prompt set and the generation settings of task=eval (quick: a first look on a CPU)",
    "serve": "the OpenAI-compatible server of task=serve",
    "tracking": "MLflow tracking (off: none)",
    "magpie": "the system messages of train_draft's self-distilled user messages",
    "hydra/launcher": "how a sweep (-m) runs its jobs: parallel (joblib, a GPU each), slurm (submitit)",
    "hydra/sweeper": "what a sweep searches: optuna_tokens_per_s (draft.num_steps, capture sizes)",
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def defaults() -> dict[str, str]:
    """The primary config's default option per group (conf/config.yaml)."""
    text = (CONF / "config.yaml").read_text()
    return dict(re.findall(r"^\s*-\s*([\w/]+):\s*(\w+)", text, re.M))


def first_sentence(path: Path, width: int = 84) -> str:
    """The first sentence of a config file's leading comment (after any `# @package` line)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("# ").rstrip())
    text = " ".join(lines)
    m = re.match(r"(.+?[.:;])(\s|$)", text)
    text = m.group(1).rstrip(".:;") if m else text
    return text if len(text) <= width else text[: width - 3].rsplit(" ", 1)[0] + "..."


def help_text() -> str:
    default = defaults()
    out = [
        "specpipe: speculative decoding from Hydra configs. A run composes a target model, a draft, the target",
        "layers the draft reads and a CUDA graph policy; validates the whole plan before any weight loads; runs",
        "eval, serve or train_draft; and logs to MLflow (outputs/mlflow.db).",
        "",
        "usage: python -m pipeline [+experiment=NAME] [GROUP=OPTION ...] [KEY=VALUE ...]",
        "       python -m pipeline ... dry_run=true          print the validated plan, run nothing (CUDA plans too)",
        "       python -m pipeline -m KEY=A,B ...            a sweep: a job per value, a summary at the end",
        "       python -m pipeline.compare --experiment NAME[,NAME...]   runs side by side",
        "",
        "config groups (GROUP=OPTION):",
    ]
    width = max(len(g) for g in GROUPS)
    for group, what in GROUPS.items():
        opts = [f"{o} (default)" if default.get(group) == o else o for o in options(group)]
        out += [f"  {group:<{width}}  {what}", f"  {'':<{width}}    {', '.join(opts)}"]
    out += ["", "experiments (+experiment=NAME; each sets experiment_name, the MLflow experiment):"]
    names = options("experiment")
    width = max(len(n) for n in names)
    out += [f"  {n:<{width}}  {first_sentence(CONF / 'experiment' / f'{n}.yaml')}" for n in names]
    out += [
        "",
        "every key, its default and what it does: docs/configuration.md (generated from schema/ and engine/drafts)",
        "the composed config of a command line: python -m pipeline ... --cfg job; Hydra's own flags: --hydra-help",
    ]
    return "\n".join(out)


def _field_comments(cls: type, prefix: str) -> dict[str, str]:
    """`_class_comments` of `cls` and of the dataclasses it extends (its own win)."""
    out: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        out.update({k: v for k, v in _class_comments(base, prefix).items() if v or k not in out})
    return out


def _class_comments(cls: type, prefix: str) -> dict[str, str]:
    """field name -> the comment lines right above it and the comment on its line, joined; a field with
    none, right below a field whose comment block stands above it, shares that block: `(see NAME)`."""
    src = textwrap.dedent(inspect.getsource(cls))
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = src.splitlines()
    out, lead, last_row = {}, None, 0
    for node in ast.parse(src).body[0].body:
        if not isinstance(node, ast.AnnAssign):
            continue
        row, above = node.lineno, []
        while row - 1 - len(above) >= 1 and lines[row - 2 - len(above)].strip().startswith("#"):
            above.insert(0, comments[row - 1 - len(above)])
        same = [comments[r] for r in range(node.lineno, node.end_lineno + 1) if r in comments]
        name = node.target.id
        if above:
            lead = name
        elif row != last_row + 1:  # a blank line ends a block's reach
            lead = None
        see = f"(see `{prefix}.{lead}`)" if prefix else f"(see `{lead}`)"
        out[name] = " ".join(above + same) or (see if lead else "")
        last_row = node.end_lineno
    return out


def _default(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(value, Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return '""' if value == "" else str(value)


def _type(cls: type, f: dataclasses.Field) -> str:
    t = str(f.type).replace("Optional[", "").rstrip("]") if "Optional[" in str(f.type) else str(f.type)
    enum = getattr(schema, t, None)
    if isinstance(enum, type) and issubclass(enum, Enum):
        return " \\| ".join(m.value for m in enum)
    return t.replace("list[", "list of ").replace("]", "").replace("[", "")


def _section(prefix: str, cls: type, out: list[str], title: str = "") -> None:
    doc = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
    out += [f"## `{title or prefix or 'top level'}` ({cls.__name__})", ""]
    if doc:
        out += [doc.replace("\n", " "), ""]
    out += ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
    comments, nested = _field_comments(cls, prefix), []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if isinstance(sub, NoDraft):  # the draft node: each draft=<name> option's own schema
            from engine.drafts.registry import SCHEMAS  # torch and every draft: not for --help

            nested += [(key, schema_, f"draft={name}") for name, schema_ in SCHEMAS.items()]
            continue
        if dataclasses.is_dataclass(sub):
            nested.append((key, type(sub), ""))
            continue
        text = comments.get(f.name, "").replace("|", "\\|")
        out.append(f"| `{key}` | {_type(cls, f)} | `{_default(f)}` | {text} |")
    out.append("")
    for key, sub, title in nested:
        _section(key, sub, out, title)


def key_reference() -> str:
    out = [
        "# Configuration keys",
        "",
        "Generated from the schema (`schema/`, each draft algorithm's in `engine/drafts/<name>/plan.py`) by",
        "`python -m pipeline.help --write`; a test keeps it current. Group options (`conf/<group>/*.yaml`) and",
        "experiments set these keys' values; `python -m pipeline --help` lists them. `draft=<name>` chooses the",
        "draft node's keys: a key that option does not have is an error.",
        "",
    ]
    _section("", schema.RunConfig, out)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> None:
    if argv == ["--write"]:
        REFERENCE.write_text(key_reference())
        print(f"wrote {REFERENCE}")
    else:
        print(help_text())


if __name__ == "__main__":
    main(sys.argv[1:])
