"""A trained head's model card, written in one place: the template card.md filled from the head's folder.

    write_card(folder, summary, objective)   folder/README.md from folder/training.json and config.json
    card_text(facts, config, tensors, summary, objective) -> str
    result_line(metrics, start, eval_k, k, vocab, export) -> str    the run's last line

`summary` and `objective` are the algorithm's own templates (its TrainSpec, engine/drafts/<name>/), filled
from the same fields: training.json's facts, `config` (config.json), `tensors` (the stored tensors'
top-level names), and the words below that read them (`vocabulary`, `not_stored`, `window`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors import safe_open

TEMPLATE = (Path(__file__).with_name("card.md")).read_text()


def stored_tensors(path: Path) -> str:
    """`fc`, `midlayer.*`, `norm`: the top-level names of the tensors in a safetensors file."""
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())
    tops = dict.fromkeys(n.split(".")[0] + (".*" if "." in n and n.count(".") > 1 else "") for n in names)
    return ", ".join(f"`{t}`" for t in tops)


def steering(system_prompts) -> str:
    """The card's and the plan's words for `train.data.system_prompts` ("" when there are none)."""
    prompts = system_prompts or []
    n = len([p for p in prompts if p])
    default = " and the default" if "" in prompts else ""
    return f", under {n} topic system messages{default} in turn" if n else ""


def _words(f: dict, config: dict) -> dict:
    """The card's words that depend on the run's settings."""
    d, t, m = f["data"], f["train"], f["metrics"]
    k = t["eval_k"]
    own_head = f.get("lm_head") != "target"
    cut = (
        f"those cut at {d['max_prompt_tokens']} tokens drawn again"
        if d.get("drop_cut_prompts")
        else f"{f['prompts_cut']:.0%} of them cut at {d['max_prompt_tokens']} tokens"
    )
    decay, ema = t.get("weight_decay"), t.get("ema_decay")
    average = ""
    if ema and f.get("weights") == "last":
        average = f"; these are the last step's own weights (the run's head is their EMA at decay {ema:g})"
    elif ema:
        average = f"; the weights are an exponential moving average of the training weights (decay {ema:g})"
    temperature = t.get("label_temperature", 1.0)
    window = config.get("sliding_window")
    return {
        # no command recorded (a run composed in-process; a card older than the field): the recipe
        "command": f.get("command") or f"python -m pipeline +experiment={f.get('experiment', 'train_eagle3_smollm2')}",
        "sampling": f"Magpie, temperature {d['prompt_temperature']}, top-p {d['prompt_top_p']}"
        f"{steering(d.get('system_prompts'))}; {cut}",
        "labels": "" if temperature == 1 else f" at temperature {temperature:g} (sharpened toward its greedy token)",
        "vocab": "draft" if own_head else "target's whole",
        "decay": f" with weight decay {decay:g} (not on norms and biases)" if decay else "",
        "average": average,
        "steps": int(m.get("train_steps", 0)),
        "train_s": m.get("train_s", 0),
        "accept_length": m.get(f"val_accept_length_k{k}", float("nan")),
        "rates": ", ".join(f"{m[f'val_accept_rate_pos_{i}']:.2f}" for i in range(k) if f"val_accept_rate_pos_{i}" in m),
        "loop": _loop(m, t),
        "vocabulary": f"with a {f['draft_vocab_size']}-token draft vocabulary"
        if own_head
        else "predicting over the target's whole vocabulary through the target's lm_head",
        "not_stored": "The token embedding is the target's and is not stored here."
        if own_head
        else "The token embedding and the lm_head are the target's and are not stored here.",
        "window": f" (each block query reads the last {window} positions: `sliding_attention` layers)"
        if window
        else "",
    }


def _loop(m: dict, t: dict) -> str:
    k, n = t["eval_k"], t.get("loop_eval_tokens")
    out = ""
    if f"val_loop_accept_length_k{k}" in m:
        out += (
            f"\nThe greedy loop replayed on every held-out answer (rounds start where the previous one "
            f"stopped; up to {n} new tokens): accept_length {m[f'val_loop_accept_length_k{k}']:.2f}."
        )
    keys = [key for key in m if key.startswith("heldout_loop_accept_length_k")]
    if keys:
        out += (
            f"\nThrough the real draft-and-verify loop (k={keys[0].rsplit('k', 1)[1]}, greedy, up to {n} new "
            f"tokens) on {int(m['heldout_loop_prompts'])} held-out prompts: accept_length {m[keys[0]]:.2f}."
        )
    return out


def card_text(facts: dict, config: dict, tensors: str, summary: str, objective: str) -> str:
    fields = {**facts, **_words(facts, config), "config": config, "tensors": tensors}
    fields["summary"] = summary.format_map(fields)
    fields["objective"] = objective.format_map(fields)
    return TEMPLATE.format_map(fields)


def write_card(folder: Path, summary: str, objective: str) -> None:
    """folder/README.md from the head's training.json, config.json and model.safetensors."""
    facts = json.loads((folder / "training.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    text = card_text(facts, config, stored_tensors(folder / "model.safetensors"), summary, objective)
    (folder / "README.md").write_text(text)


def result_line(metrics: dict, start: dict, eval_k: int, k: int, vocab: int, export: Path) -> str:
    """The run's last line: held-out acceptance (and through the real loop) and loss beside the untrained
    head's (step 0) and a uniform guess's; a WARNING when the loss never left that floor."""
    loss, floor = metrics["val_loss"], math.log(vocab)
    acc, loop = f"val_accept_length_k{eval_k}", f"heldout_loop_accept_length_k{k}"
    was = lambda key, f: f" ({start[key]:{f}} at step 0)" if key in start else ""  # noqa: E731
    in_loop = (
        f", {metrics[loop]:.2f} in the real loop (k={k}, {metrics['heldout_loop_prompts']:.0f} prompts)"
        if loop in metrics
        else ""
    )
    line = (
        f"[train_draft] {metrics['train_steps']} steps in {metrics['train_s']:.0f}s: held-out accept_length"
        f"(k={eval_k}) {metrics[acc]:.2f}{was(acc, '.2f')}{in_loop}; loss {loss:.3f}{was('val_loss', '.3f')}, "
        f"a uniform guess's {floor:.3f} -> {export}"
    )
    if loss >= 0.95 * floor:
        line += (
            f"\nWARNING: the held-out loss {loss:.3f} is no better than a uniform guess's ln({vocab}) = "
            f"{floor:.3f}: the target's next tokens are near uniform (nothing to learn from them), or the head "
            "learned nothing"
        )
    return line
