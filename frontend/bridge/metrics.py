"""Prometheus metrics: the engine's numbers (from `get_stats`) and latencies seen here.

Engine counters are cumulative in the scheduler, so they are exported as they
are by a custom collector (a restarted engine shows up as a counter reset,
which Prometheus handles) rather than re-counted in the bridge. Latency
histograms are observed from the deltas the bridge relays.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from noria.frontend.bridge.vllm_metrics import VllmCollector
from noria.protocol.client import SchedulerStats, Stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
# Tokens per request: 1, 2, 5, 10, ... 1,000,000 (vLLM's 1-2-5 series).
_LENGTH_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)

# (metric name, SchedulerStats field, help)
_GAUGES = (
    ("noria_num_requests_running", "num_running", "Requests in the running batch."),
    ("noria_num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("noria_num_requests_swapped", "num_swapped", "Requests whose KV blocks are swapped to CPU memory."),
    ("noria_kv_cache_usage_ratio", "kv_cache_usage", "Fraction of device KV cache blocks in use (0..1)."),
    ("noria_kv_cache_blocks", "num_kv_blocks", "Device KV cache blocks in all."),
    ("noria_kv_cache_free_blocks", "num_free_blocks", "Device KV cache blocks not owned by a request."),
    ("noria_workers_live", "workers_live", "1 while a worker group serves the engine."),
    ("noria_seconds_without_worker", "seconds_without_worker", "Seconds in all without a live worker group."),
    ("noria_kv_transfers_held", "kv_transfers_held", "Prompts whose KV blocks a producer holds for a consumer."),
)
_COUNTERS = (
    ("noria_prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("noria_prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("noria_num_preemptions", "num_preemptions", "Requests preempted for lack of KV blocks."),
    ("noria_swap_outs", "num_swap_outs", "Requests swapped out to CPU memory."),
    ("noria_swap_ins", "num_swap_ins", "Requests swapped back in."),
    ("noria_prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests."),
    ("noria_generation_tokens", "generation_tokens", "Tokens generated."),
    ("noria_engine_steps", "num_steps", "Engine steps run."),
    ("noria_worker_restarts", "worker_restarts", "Worker groups formed again after a loss."),
    ("noria_requests_requeued", "requests_requeued", "Running or swapped requests re-queued by a worker loss."),
    ("noria_tokens_recomputed", "tokens_recomputed", "Computed tokens whose KV a worker loss threw away."),
    ("noria_kv_transfers_released", "kv_transfers_released", "Held transfers a consumer released (producer)."),
    ("noria_kv_transfers_expired", "kv_transfers_expired", "Held transfers freed at their timeout (producer)."),
    ("noria_kv_pulls_ok", "kv_pulls_ok", "Prompts whose KV was pulled whole from a producer (consumer)."),
    ("noria_kv_pulls_failed", "kv_pulls_failed", "Pulls that failed: the prompt was computed here or failed."),
    ("noria_kv_pull_bytes", "kv_pull_bytes", "KV bytes pulled from producers (consumer)."),
    ("noria_kv_pull_tokens", "kv_pull_tokens", "Prompt tokens whose KV was pulled instead of computed."),
    ("noria_kv_pull_seconds", "kv_pull_seconds", "Seconds the workers spent pulling KV blocks."),
    ("noria_spec_decode_drafts", "spec_drafts", "Drafts verified (speculative decoding)."),
    ("noria_spec_decode_draft_tokens", "spec_draft_tokens", "Draft tokens verified."),
    ("noria_spec_decode_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted."),
)


class EngineCollector(Collector):
    """Exports the latest `stats` reply; zeros (and noria_engine_up 0) before the first."""

    def __init__(self) -> None:
        self.stats: Stats | None = None
        self.up = False

    def update(self, stats: Stats | None) -> None:
        self.up = stats is not None
        if stats is not None:
            self.stats = stats

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("noria_engine_up", "1 when the engine answered the last stats query.", value=int(self.up))
        s = self.stats.stats if self.stats else SchedulerStats()
        yield GaugeMetricFamily(
            "noria_num_open_requests", "Client requests open in the frontend.",
            value=self.stats.num_open_requests if self.stats else 0,
        )
        yield CounterMetricFamily(
            "noria_scheduler_restarts", "Schedulers started again after one died.",
            value=self.stats.scheduler_restarts if self.stats else 0,
        )
        for name, field, doc in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(getattr(s, field)))
        for name, field, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(getattr(s, field)))


class BridgeMetrics:
    """One registry per bridge (not the process-global one), so that tests may build several."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineCollector()
        self.registry.register(self.engine)
        self.vllm = VllmCollector()
        self.registry.register(self.vllm)
        r = self.registry
        self.ttft = Histogram("noria_time_to_first_token_seconds", "Time from request to its first token.", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("noria_inter_token_latency_seconds", "Time between consecutive tokens of a sample.", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("noria_e2e_request_latency_seconds", "Time from request to its final message.", buckets=_E2E_BUCKETS, registry=r)
        self.prompt_len = Histogram("noria_request_prompt_tokens", "Prompt tokens of a finished request.",
                                    buckets=_LENGTH_BUCKETS, registry=r)
        self.output_len = Histogram("noria_request_generation_tokens", "Tokens a finished request generated "
                                    "(all its samples).", buckets=_LENGTH_BUCKETS, registry=r)
        self.success = Counter("noria_request_success", "Requests that ended with done, by finish reason.", ["finish_reason"], registry=r)
        self.failure = Counter("noria_request_failure", "Requests that ended with an error, by error code.", ["code"], registry=r)
        self.slow_readers = Counter("noria_slow_reader_aborts", "Streams aborted because their client left more than "
                                    "--stream-buffer bytes unread, by surface.", ["surface"], registry=r)
        self.refused = Counter("noria_connections_refused", "Connections answered 503 at once: --max-connections "
                               "were open.", registry=r)
        self.body_timeouts = Counter("noria_http_body_timeouts", "Requests answered 408: their body did not come "
                                     "within --http-body-timeout.", registry=r)

        v = self.vllm
        v.ttft, v.itl, v.e2e, v.prompt_len, v.output_len, v.success = (
            self.ttft, self.itl, self.e2e, self.prompt_len, self.output_len, self.success)

    def update(self, stats: Stats | None, model: str | None) -> None:
        """The engine's latest stats (None: it did not answer) and the served model's name."""
        self.engine.update(stats)
        self.vllm.stats = self.engine.stats
        if model:
            self.vllm.model = model

    def render(self) -> bytes:
        return generate_latest(self.registry)
