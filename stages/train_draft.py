"""Stage `train_draft`: self-distil data from the target, then train the draft head (engine/train/).

    plan:   load -> configure_aux_capture -> train_draft          (task=train_draft)
    output: <outputs>/train/data/<key>/  the samples, keyed by the target and train.data (engine/train/data.py)
            <outputs>/train/<train.name>/checkpoint/  the head in float32 + trainer_state.pt (resume)
            <outputs>/train/<train.name>/head/        config.json, model.safetensors (bfloat16), training.json,
                                                      README.md (engine/train/card.py); head_last/ with an EMA

An adapter: it builds the generator for the self-distillation (engine/train/selfdistill.py), a float32
copy of the loaded head (its draft vocabulary and output layer from the data and the target when it starts
from random weights), hands the `train` config to the Trainer as it is, then measures the head through the
real draft-and-verify loop and exports it. Under torchrun every rank synthesises and trains its share;
rank 0 alone evaluates and exports. Provides `draft_checkpoint` (the export's path).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import torch

from engine.drafts.registry import make_draft, train_spec
from engine.errors import ConfigError, raise_all, raised
from engine.graphs.runner import default_sizes
from engine.sampling import SamplingParams
from engine.speculative.generate import Generator
from engine.speculative.graph_set import GraphSet
from engine.train import distributed
from engine.train.card import result_line, steering, write_card
from engine.train.checks import train_problems
from engine.train.data import VocabMap, cached_samples, describe_data, split
from engine.train.selfdistill import FIXED, synthesize
from engine.train.trainer import Trainer, train_attention, train_kernels
from schema import REPO
from stages.base import Stage, StageEnv, device_name, register_stage


def train_dir(cfg, env: StageEnv) -> Path:
    return env.outputs_dir / "train" / (cfg.train.name or cfg.experiment_name)


def export_path(export_dir: str) -> Path:
    return Path(export_dir) if Path(export_dir).is_absolute() else REPO / export_dir


def place_problems(cfg, env: StageEnv) -> list[ConfigError]:
    """The run's folder is a plain name under <outputs>/train; train.export_dir, which the export
    replaces, is new, empty or an exported head's, and neither holds the repository nor the outputs."""
    errors, name = [], cfg.train.name or cfg.experiment_name
    key = "train.name" if cfg.train.name else "experiment_name"
    if name in (".", "..") or "/" in name or "\\" in name:
        errors.append(ConfigError(key, name, "names the run's folder under <outputs>/train", "a name without / or .."))
    if not cfg.train.export_dir:
        return errors
    dest = export_path(cfg.train.export_dir).resolve()
    kept = [p for p in (REPO.resolve(), env.outputs_dir.resolve()) if p == dest or dest in p.parents]
    problem = None
    if kept:
        problem = f"replacing it would delete {kept[0]}"
    elif dest.exists() and not (dest.is_dir() and (not any(dest.iterdir()) or (dest / "config.json").is_file())):
        problem = "not a draft head: it would be replaced"
    elif not os.access(parent := next(p for p in (dest, *dest.parents) if p.exists()), os.W_OK):
        problem = f"{parent} is not writable"
    if problem:
        valid = "a new or empty folder, or an exported head's (config.json) to replace"
        errors.append(ConfigError("train.export_dir", cfg.train.export_dir, problem, valid))
    return errors


@register_stage
class TrainDraftStage(Stage):
    name = "train_draft"
    requires = ("target", "draft_head")
    provides = ("draft_checkpoint",)
    final = True
    runs_target = True

    def kv_rows(self, cfg) -> tuple[str, int]:
        return "train.data.batch_size", cfg.train.data.batch_size  # the self-distillation's generator

    def check(self, cfg, env: StageEnv) -> None:
        """Every bad value at once: train.*, and the draft's own training checks."""
        d, spec, errors = cfg.draft, None, []
        try:
            spec = train_spec(d.algorithm)
        except ConfigError as e:
            errors.append(e)
        if spec is not None and spec.check is not None and env.draft_plan is not None:  # None: its error is reported
            errors += raised(spec.check, cfg, env.draft_plan)
        flex = spec is not None and spec.flex
        errors += train_problems(cfg.train, d.algorithm, flex, env.device, cfg.model.max_seq_len)
        errors += place_problems(cfg, env)
        dv, eos = getattr(d, "draft_vocab_size", None), env.target_args.eos_token_ids
        if getattr(d, "init", None) == "random" and dv is not None and dv < len(eos) + 1:
            errors.append(
                ConfigError(
                    "draft.draft_vocab_size",
                    dv,
                    "too small to hold the stop tokens",
                    f"2..{env.target_args.vocab_size}",
                )
            )
        raise_all(errors)

    def describe(self, cfg, env: StageEnv) -> str:
        t, spec = cfg.train, train_spec(cfg.draft.algorithm)
        return (
            f"self-distil {t.data.num_samples} samples (graph {'full' if env.device.type == 'cuda' else 'none'}"
            f"{steering(t.data.system_prompts)}), hold out {t.heldout:.0%}; "
            f"{t.steps} steps, TTT {t.ttt_steps} steps, lr {t.lr:g}, {t.max_tokens} tokens/batch"
            f"{f', stop after {t.max_time_s:g}s' if t.max_time_s else ''}, "
            f"attention {train_attention(t.attention, spec, env.device)}, "
            f"kernels {train_kernels(t.kernels, env.device)}"
            f"{f', labels at T {t.label_temperature:g}' if t.label_temperature != 1 else ''}"
            f"{f', EMA {t.ema_decay:g}' if t.ema_decay else ''}; -> {train_dir(cfg, env)}"
        )

    def run(self, cfg, inputs, env: StageEnv) -> dict:
        t, loaded, spec = cfg.train, inputs["target"], train_spec(cfg.draft.algorithm)
        target, out = loaded.model, train_dir(cfg, env)
        out.mkdir(parents=True, exist_ok=True)
        log = env.tracker.log_metrics if env.tracker is not None else (lambda m, step=0: None)

        train, heldout, data = self._data(cfg, loaded, env, log)
        student = self._student(cfg, inputs["draft_head"], target, train, env, spec)
        trainer = Trainer(student, target, train, heldout, VocabMap.of(student), t, out, log, spec, cfg.seed)
        if trainer.graphs is not None and distributed.is_main():
            g = trainer.graphs.stats
            print(f"[train_draft] target graphs: {len(g.buckets)} batch shapes in {g.capture_s:.1f}s", flush=True)
        metrics = trainer.fit(resume=t.resume)
        if trainer.graphs is not None:
            g = trainer.graphs.stats
            metrics.update(target_graph_capture_s=g.capture_s, target_graph_fallbacks=g.fallbacks)
            log({k: metrics[k] for k in ("target_graph_capture_s", "target_graph_fallbacks")}, trainer.step)
        export = out / "head"
        if not distributed.is_main():  # rank 0 evaluates and exports (the other ranks print nothing: execute)
            return {"draft_checkpoint": str(export)}
        if t.loop_eval_prompts > 0:
            metrics.update(
                loop_acceptance(env.draft_plan, student, target, heldout[: t.loop_eval_prompts], cfg, loaded)
            )
            log({k: v for k, v in metrics.items() if k.startswith("heldout_")}, trainer.step)

        self._export(student, export, cfg, metrics, data, env, spec, ema=True)
        shutil.rmtree(out / "head_last", ignore_errors=True)  # an earlier run's twin would be stale
        if trainer.last_weights is not None:  # EMA: the last step's own weights too, for comparison
            last = student.copy(env.device, torch.float32)
            own = dict(last.named_parameters())
            trained = [own[n].data for n, p in student.named_parameters() if p.requires_grad]
            torch._foreach_copy_(trained, trainer.last_weights)
            figures = {k: v for k, v in metrics.items() if not k.startswith(("val_", "heldout_", "last_"))}
            figures.update({k[5:]: v for k, v in metrics.items() if k.startswith("last_")})
            self._export(last, out / "head_last", cfg, figures, data, env, spec, ema=False)
        if t.export_dir:  # copied beside it, then swapped in: never a half-copied head
            dest = export_path(t.export_dir)
            staged = dest.with_name(f".{dest.name}.{os.getpid()}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staged, ignore_errors=True)  # a killed run's leftover: nothing of it merges in
            shutil.copytree(export, staged)
            shutil.rmtree(dest, ignore_errors=True)
            staged.rename(dest)
        if env.tracker is not None:
            for f in sorted(export.iterdir()):
                env.tracker.client.log_artifact(env.tracker.run_id, str(f), "draft_head")
        vocab = getattr(student, "draft_vocab_size", None) or env.target_args.vocab_size
        print(result_line(metrics, trainer.start_metrics, t.eval_k, cfg.draft.k, vocab, export), flush=True)
        return {"draft_checkpoint": str(export)}

    def _data(self, cfg, loaded, env: StageEnv, log) -> tuple[list, list, dict]:
        """The self-distilled samples (cached by the target and train.data), split -> (train, held out, the
        data's figures)."""
        d, model = cfg.train.data, loaded.model
        # a random target is its architecture, seed and weight scale (its checkpoint is just "random")
        target = dataclasses.asdict(cfg.model.random) if cfg.model.source == "random" else str(loaded.checkpoint)
        # how the decoding ran (graphs, host looks) does not change the samples: not in the key
        meta = {"target": target, "data": {**dataclasses.asdict(d), **FIXED, "graph": None, "sync_every": None}}

        def make(phase_s: dict, shard: tuple[int, int]) -> list:
            model.set_batch_invariant(False)  # cuBLAS at generation batches: no output compared across sizes
            try:
                t0, graphs, sizes = time.perf_counter(), None, default_sizes(d.batch_size)
                if env.device.type == "cuda":  # the decode under CUDA graphs
                    graphs = GraphSet(model, None, d.batch_size, 0, "full", "none", sizes, [], False, sampled=True)
                    graphs.capture()
                phase_s["graphs"] = time.perf_counter() - t0
                gen = Generator(model, d.batch_size, graphs=graphs)
                n = distributed.share(d.num_samples, *shard)
                return synthesize(
                    loaded, gen, n, d.max_prompt_tokens, d.max_answer_tokens, min_prompt_chars=d.min_prompt_chars,
                    system_prompts=list(d.system_prompts), drop_cut=d.drop_cut_prompts, phase_s=phase_s, shard=shard,
                )  # fmt: skip
            finally:
                model.set_batch_invariant(True)

        samples, data_s, phase_s, reused = cached_samples(env.outputs_dir / "train" / "data", meta, make)
        train, heldout = split(samples, cfg.train.heldout, cfg.seed)
        data, figures, text = describe_data(
            samples, train, heldout, data_s, phase_s, reused, d.max_prompt_tokens, loaded.tokenizer.decode
        )
        log(figures)
        print(text, flush=True)
        return train, heldout, data

    def _student(self, cfg, head, target, train, env: StageEnv, spec):
        """A float32 trainable copy of the loaded head: from scratch, its draft vocabulary (EAGLE3 with an
        lm_head of its own) from the training split, then its output layer from the target's."""
        student = head.copy(env.device, torch.float32)
        if cfg.draft.init == "random":
            if spec.prepare is not None:  # EAGLE3: its draft vocabulary
                spec.prepare(student, (s.ids for s in train), sorted(set(target.args.eos_token_ids)))
            if hasattr(student, "init_from_target"):
                student.init_from_target(target)
        return student.requires_grad_(True)

    def _export(self, student, path: Path, cfg, metrics, data: dict, env, spec, ema: bool) -> None:
        """The head in bfloat16, training.json (the run's facts) and its card. ema=False: these are the last
        step's own weights of a run with train.ema_decay (the card and training.json say so)."""
        export = student.copy(torch.device("cpu"), torch.bfloat16)
        shutil.rmtree(path, ignore_errors=True)
        export.save(path)
        facts = {
            "experiment": cfg.experiment_name,
            "command": "python -m pipeline " + " ".join(env.command or [f"+experiment={cfg.experiment_name}"]),
            "target": cfg.model.name,
            "target_checkpoint": str(env.weights_dir),
            "device": device_name(env.device),
            "samples": data["samples"],
            "answer_tokens": data["answer_tokens"],
            "prompts_cut": round(data["prompts_cut"], 4),
            "data_s": round(data["data_s"], 1),
            "data": {**dataclasses.asdict(cfg.train.data), **FIXED},
            "heldout": cfg.train.heldout,
            "train": {k: v for k, v in dataclasses.asdict(cfg.train).items() if k != "data"},
            "weights": "ema" if ema and cfg.train.ema_decay else "last",
            "algorithm": cfg.draft.algorithm,
            "architecture": export.architecture,
            "draft_vocab_size": getattr(export, "draft_vocab_size", env.target_args.vocab_size),
            "lm_head": "target" if export.shares_lm_head else "own",
            "aux_layer_ids_output_of": list(env.draft_plan.aux.output_of) if env.draft_plan.aux else None,
            "metrics": {k: round(float(v), 4) for k, v in metrics.items()},
        }
        (path / "training.json").write_text(json.dumps(facts, indent=2, default=str))
        write_card(path, spec.summary, spec.objective)


@torch.no_grad()
def loop_acceptance(plan, student, target, prompts, cfg, loaded) -> dict[str, float]:
    """Acceptance through the real draft-and-verify loop (engine.speculative.generate) on held-out prompts: rounds
    start where the previous one stopped, unlike the per-anchor chain estimate of the training eval."""
    k, device = cfg.draft.k, target.lm_head.weight.device
    head = student.copy(device, target.lm_head.weight.dtype).eval()
    params = SamplingParams(max_new_tokens=cfg.train.loop_eval_tokens)
    batch = min(16, len(prompts))
    gen = Generator(target, batch, make_draft(plan, head, target, batch, k, cfg=cfg.draft), k)
    accepts = []
    for i in range(0, len(prompts), batch):
        for r in gen.generate([p.prompt_ids for p in prompts[i : i + batch]], params, loaded.tokenizer.eos_token_ids):
            accepts += r.accepts
    return {
        f"heldout_loop_accept_length_k{k}": sum(a + 1 for a in accepts) / max(len(accepts), 1),
        "heldout_loop_prompts": float(len(prompts)),
    }
