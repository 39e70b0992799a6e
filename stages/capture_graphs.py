"""Stage `capture_graphs`: build and capture the run's graphs per the `graph` config group.

Runs after `load` (the draft head already shares the target's embedding) and after
`configure_aux_capture` (the target's verify/prefill graphs include the aux outputs): the plan
enforces the order, and every graph records the aux ids and embedding storage it was captured with,
so a replay against a model that changed since raises instead of returning wrong tensors.

Provides `graphs` (engine.speculative.graph_set.GraphSet: the runners, the caches they replay over, one
memory pool). Logs `capture_s`, `graph_mem_mb` (totals and `.<phase>`).
"""

from __future__ import annotations

from engine.drafts.registry import make_draft
from engine.errors import ConfigError
from engine.graphs.backends import NEEDS_CUDA, POLICIES
from engine.graphs.runner import default_sizes
from engine.speculative.graph_set import GraphSet
from stages.base import Stage, StageEnv, register_stage


def capture_sizes(cfg) -> list[int]:
    """graph.capture_sizes, else 1, 2, 4, ... up to the cache's rows (a server's round spans its slots
    up to the last occupied one: under a light load a small bucket replays)."""
    g = cfg.graph
    if g.capture_sizes:
        return sorted(set(g.capture_sizes))
    return default_sizes(max_batch(cfg))


def run_batch(cfg) -> tuple[str, int]:
    """(key, rows) of the batch the final stage runs: serve's slots, or eval's batch."""
    if cfg.task == "serve":
        return "serve.max_batch_size", cfg.serve.max_batch_size
    return "eval.batch_size", cfg.eval.batch_size


def max_batch(cfg) -> int:
    return cfg.graph.max_batch_size or run_batch(cfg)[1]


def prefill_buckets(cfg) -> list[int]:
    """The prefill graphs' buckets: those of graph.prefill_buckets that fit model.max_seq_len."""
    return [n for n in cfg.graph.prefill_buckets if n <= cfg.model.max_seq_len]


def prefill_rows(cfg) -> int | None:
    """Rows of the staging caches the prefill graphs write: a server's joins go through them (serve.join_rows,
    at most its slots); None: the graphs write the batch's own cache."""
    return min(cfg.serve.join_rows, cfg.serve.max_batch_size) if cfg.task == "serve" else None


def samples(cfg) -> bool:
    """The run draws tokens (rounds with rejection sampling are captured too): a server, or an eval
    with temperature > 0."""
    return cfg.task == "serve" or (cfg.task == "eval" and cfg.eval.temperature > 0)


def adaptive_k(cfg) -> bool:
    """Rounds pick their draft tokens from the load (engine/speculative/adaptive_k.py)."""
    if cfg.draft.k == 0:
        return False
    return cfg.serve.adaptive_k if cfg.task == "serve" else cfg.task == "eval" and cfg.eval.adaptive_k


def round_ks(cfg, k: int) -> list[int]:
    """Draft tokens per round of the rounds to capture: the draft's k; 0 (the plain decode step) for an
    eval's no-draft baseline; every k in 0..k with adaptive k."""
    if adaptive_k(cfg):
        return list(range(k + 1))
    return sorted({k, 0}) if cfg.task == "eval" and cfg.eval.baseline is not False else [k]


def uses_graphs(cfg) -> bool:
    return cfg.graph.target != "none" or (cfg.draft.k > 0 and cfg.graph.draft != "none")


@register_stage
class CaptureGraphsStage(Stage):
    name = "capture_graphs"
    requires = ("target", "draft_head")
    provides = ("graphs",)
    runs_target = True

    @classmethod
    def needed(cls, cfg, draft) -> bool:
        return uses_graphs(cfg)

    def check(self, cfg, env: StageEnv) -> None:
        g = cfg.graph
        for key, policy in (
            ("graph.policy", g.policy),
            ("graph.target_policy", g.target),
            ("graph.draft_policy", g.draft),
        ):
            if policy not in POLICIES:
                raise ConfigError(key, policy, "unknown graph policy", POLICIES)
        sizes = capture_sizes(cfg)
        if min(sizes) < 1:
            if g.capture_sizes is None:  # sizes from the run's batch: its own stage names that key
                return
            raise ConfigError("graph.capture_sizes", list(g.capture_sizes), "batch sizes must be >= 1", ">= 1")
        key, batch = run_batch(cfg)
        if max(sizes) > max_batch(cfg):
            raise ConfigError(
                "graph.capture_sizes",
                sizes,
                f"larger than the cache's {max_batch(cfg)} rows",
                f"sizes <= graph.max_batch_size (or {key}) = {max_batch(cfg)}",
            )
        if max_batch(cfg) < batch:
            raise ConfigError("graph.max_batch_size", g.max_batch_size, f"below {key}={batch}", f">= {batch}, or null")
        if batch > max(sizes):
            k = cfg.draft.k
            env.notes.append(
                f"batches of {max(sizes) + 1}..{batch} rows ({(max(sizes) + 1) * (k + 1)}+ verify "
                f"tokens) exceed the largest capture size {max(sizes)}: they run eagerly (counted as fallbacks)"
            )

    def describe(self, cfg, env: StageEnv) -> str:
        k = cfg.draft.k
        sizes = capture_sizes(cfg)
        line = (
            f"target {cfg.graph.target}, draft {cfg.graph.draft if env.draft_plan else '-'}; capture sizes "
            f"{sizes} (verify tokens {[b * (k + 1) for b in sizes]}), rounds of k in {round_ks(cfg, k)}"
            f"{' (adaptive k)' if adaptive_k(cfg) else ''}, largest first, one memory pool"
        )
        if cfg.graph.target != "none" and cfg.graph.prefill_buckets:
            line += f"; prefill buckets {list(cfg.graph.prefill_buckets)} tokens" + (
                f" (joins: up to {prefill_rows(cfg)} prompt{'s' if prefill_rows(cfg) > 1 else ''} a replay, "
                "into staging rows)"
                if cfg.task == "serve"
                else ""
            )
        return line

    def run(self, cfg, inputs, env: StageEnv) -> dict:
        plan, head, target = env.draft_plan, inputs["draft_head"], inputs["target"].model
        if head is not None and head.embed is not target.model.embed_tokens:
            raise RuntimeError(
                "the draft head does not share the target's embedding: capturing its graphs now "
                "would bake in memory that is not the target's"
            )
        k = cfg.draft.k
        batch = max_batch(cfg)
        draft = None  # a device draft: its caches and state buffers are what the rounds replay over
        if plan is not None and plan.spec.head is not None:
            draft = make_draft(plan, head, target, batch, k, cfg=cfg.draft)
        graphs = GraphSet(
            target,
            draft,
            batch,
            k,
            cfg.graph.target,
            cfg.graph.draft if plan is not None else "none",
            capture_sizes(cfg),
            prefill_buckets(cfg),
            features=plan is not None and plan.features.value != "none",
            sampled=samples(cfg),
            round_ks=round_ks(cfg, k),
            prefill_rows=prefill_rows(cfg),
        ).capture()
        m = graphs.metrics()
        if env.tracker is not None:
            env.tracker.log_metrics({k: v for k, v in m.items() if k.startswith(("capture_s", "graph_mem_mb"))})
        n = sum(len(r.buckets) for r in graphs.runners.values())
        captured = {cfg.graph.target, cfg.graph.draft if plan is not None else "none"} & NEEDS_CUDA
        what = (
            f"{n} graphs in {m['capture_s']:.2f}s, {m['graph_mem_mb']:.1f} MB"
            if captured
            else f"{n} graph shapes set up, none captured (debug: each runs eagerly through the runner's buffers)"
        )
        print(f"[capture_graphs] {len(graphs.runners)} phases, {what}", flush=True)
        return {"graphs": graphs}
