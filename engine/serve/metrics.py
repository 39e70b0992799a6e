"""Prometheus metrics of a server, in its own registry (never the process-global one).

Counters and gauges are read at scrape time from a snapshot of the engine (engine/serve/link.py: the
scheduler's `ServeStats` and the graph runners' counts; one source of truth, no double bookkeeping);
latencies are histograms the front observes per request.

    specpipe_requests_total{finish_reason}           finished requests: stop | length | abort | error
    specpipe_requests_rejected_total{status}         answered 4xx/5xx before reaching the engine
    specpipe_prompt_tokens_total, specpipe_generation_tokens_total
    specpipe_rounds_total, specpipe_verify_rows_total   draft-and-verify rounds; live rows they verified
    specpipe_rounds_by_draft_tokens_total{k}, specpipe_draft_tokens   rounds per k; the last round's k
    specpipe_accept_length                           tokens per verify round and row, bonus included
    specpipe_draft_tokens_proposed_total, specpipe_draft_tokens_accepted_total   over speculating rows
    specpipe_requests_not_speculative_total          requests that turned speculation off
    specpipe_accept_rate{position}                   fraction of row rounds whose draft token i was kept
    specpipe_graph_replays_total{phase}, specpipe_graph_fallbacks_total{phase}   (fallback: ran eagerly)
    specpipe_queue_depth, specpipe_running_requests, specpipe_slots
    specpipe_request_latency_seconds, specpipe_time_to_first_token_seconds   histograms
    specpipe_request_accept_length, specpipe_request_draft_tokens_per_round   histograms, per request
                                                     that ran a verify round (its usage.speculation)
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.serve.link import EngineSnapshot

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, float("inf"))
ACCEPT_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, float("inf"))  # tokens per round
K_BUCKETS = (0, 0.5, 1, 1.5, 2, 3, 4, 5, 6, 8, float("inf"))  # draft tokens per round


class _EngineCollector(Collector):
    def __init__(self):
        self.snap: Optional[EngineSnapshot] = None  # the engine's counters of this scrape (None: it is gone)

    def collect(self):
        if self.snap is None:
            return
        s, st = self.snap, self.snap.stats
        done = CounterMetricFamily("specpipe_requests", "Finished requests", labels=["finish_reason"])
        for reason, n in list(st.finished.items()):
            done.add_metric([reason], n)
        yield done
        yield CounterMetricFamily(
            "specpipe_prompt_tokens", "Prompt tokens of submitted requests", value=st.prompt_tokens
        )
        yield CounterMetricFamily("specpipe_generation_tokens", "Generated tokens", value=st.generated_tokens)
        yield CounterMetricFamily(
            "specpipe_rounds", "Draft-and-verify rounds (decode steps without a draft)", value=st.rounds
        )
        yield CounterMetricFamily("specpipe_verify_rows", "Live rows verified, summed over rounds", value=st.row_rounds)
        by_k = CounterMetricFamily(
            "specpipe_rounds_by_draft_tokens",
            "Rounds per draft tokens k (adaptive k picks k from the load)",
            labels=["k"],
        )
        for k, n in sorted(st.rounds_by_k.items()):
            by_k.add_metric([str(k)], n)
        yield by_k
        yield GaugeMetricFamily("specpipe_draft_tokens", "The last round's draft tokens k", value=st.last_k)
        yield GaugeMetricFamily(
            "specpipe_accept_length",
            "Tokens emitted per verify round and row, bonus included",
            value=st.accept_length if st.row_rounds else 0.0,
        )
        yield CounterMetricFamily(
            "specpipe_draft_tokens_proposed", "Draft tokens proposed to speculating rows", value=st.draft_tokens
        )
        yield CounterMetricFamily("specpipe_draft_tokens_accepted", "Draft tokens accepted", value=st.accepted_tokens)
        yield CounterMetricFamily(
            "specpipe_requests_not_speculative",
            "Submitted requests that turned speculation off (speculative: false)",
            value=st.not_speculative,
        )
        rate = GaugeMetricFamily(
            "specpipe_accept_rate",
            "Fraction of row rounds whose draft token at this position was accepted",
            labels=["position"],
        )
        for i, r in enumerate(st.accept_rates()):
            rate.add_metric([str(i)], r if st.row_rounds else 0.0)
        yield rate
        replays = CounterMetricFamily("specpipe_graph_replays", "Graph replays", labels=["phase"])
        fallbacks = CounterMetricFamily(
            "specpipe_graph_fallbacks",
            "Calls that ran eagerly (no graph for the batch, or a hidden-state mode not captured)",
            labels=["phase"],
        )
        for phase, (n_replays, n_fallbacks) in s.graphs.items():
            replays.add_metric([phase], n_replays)
            fallbacks.add_metric([phase], n_fallbacks)
        yield replays
        yield fallbacks
        yield GaugeMetricFamily("specpipe_queue_depth", "Requests waiting for a slot", value=s.queue_depth)
        yield GaugeMetricFamily("specpipe_running_requests", "Requests holding a slot", value=s.running)
        yield GaugeMetricFamily("specpipe_slots", "Slots (serve.max_batch_size)", value=s.slots)


class ServeMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine = _EngineCollector()
        self.registry.register(self.engine)
        self.rejected = Counter(
            "specpipe_requests_rejected",
            "Requests answered with an error status before reaching the engine",
            ["status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "specpipe_request_latency_seconds",
            "Request latency, arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "specpipe_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.accept_length = Histogram(
            "specpipe_request_accept_length",
            "A request's tokens per verify round, bonus included",
            buckets=ACCEPT_BUCKETS,
            registry=self.registry,
        )
        self.mean_k = Histogram(
            "specpipe_request_draft_tokens_per_round",
            "A request's draft tokens proposed per verify round (0: no draft, or speculation off)",
            buckets=K_BUCKETS,
            registry=self.registry,
        )

    def render(self, snap: Optional[EngineSnapshot]) -> bytes:
        self.engine.snap = snap
        return generate_latest(self.registry)
