"""vLLM's metric names beside noria's own, for the routers and dashboards that read them.

llm-d's endpoint picker scores an engine by `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
(older releases: `vllm:gpu_cache_usage_perc`), `vllm:lora_requests_info` and the KV capacity in
`vllm:cache_config_info`'s labels; vLLM's Grafana dashboard reads the token counters, the finish
reasons and the latency and length histograms. Every series carries vLLM's `model_name` and
`engine` labels. Nothing is counted twice: the numbers are noria's (the engine's stats, the
bridge's histograms), renamed as they are collected.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from noria.protocol.client import SchedulerStats, Stats

_LABELS = ["model_name", "engine"]

# (vLLM's name, SchedulerStats field, help)
_GAUGES = (
    ("vllm:num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("vllm:num_requests_swapped", "num_swapped", "Number of requests swapped to CPU memory."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:gpu_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage. "
     "DEPRECATED: use vllm:kv_cache_usage_perc."),
)
_COUNTERS = (
    ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    ("vllm:num_preemptions", "num_preemptions", "Cumulative number of preemptions from the engine."),
    ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in queried tokens."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in cached tokens."),
    ("vllm:spec_decode_num_drafts", "spec_drafts", "Number of spec decoding drafts."),
    ("vllm:spec_decode_num_draft_tokens", "spec_draft_tokens", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Number of accepted tokens."),
)


def _mirror_histogram(name: str, doc: str, hist: Histogram, labels: list[str]) -> HistogramMetricFamily:
    """`hist` (unlabelled) under `name` with vLLM's labels."""
    buckets: list[tuple[str, float]] = []
    total = 0.0
    for metric in hist.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                buckets.append((sample.labels["le"], sample.value))
            elif sample.name.endswith("_sum"):
                total = sample.value
    family = HistogramMetricFamily(name, doc, labels=_LABELS)
    family.add_metric(labels, buckets, total)
    return family


def _mirror_by_reason(name: str, doc: str, counter: Counter, labels: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[*_LABELS, "finished_reason"])
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                family.add_metric([*labels, sample.labels["finish_reason"]], sample.value)
    return family


class VllmCollector(Collector):
    """Collects at scrape time from the engine collector's latest stats and the bridge's metrics."""

    def __init__(self, stats: Stats | None = None) -> None:
        self.stats = stats
        self.model = ""
        # Set by BridgeMetrics once its own metrics exist.
        self.ttft: Histogram | None = None
        self.itl: Histogram | None = None
        self.e2e: Histogram | None = None
        self.prompt_len: Histogram | None = None
        self.output_len: Histogram | None = None
        self.success: Counter | None = None

    def engines(self) -> list[tuple[str, SchedulerStats]]:
        """(engine label, stats) per engine: each of a data-parallel group's, else this server's
        one, labelled with its --data-parallel-rank (0 alone), as vLLM labels its engines."""
        if self.stats is None:
            return [("0", SchedulerStats())]
        if self.stats.engines:
            return [(str(i), s) for i, s in enumerate(self.stats.engines)]
        return [(str(self.stats.data_parallel_rank), self.stats.stats)]

    def collect(self) -> Iterator[Metric]:
        engines = self.engines()
        for name, field, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=_LABELS)
            for engine, s in engines:
                g.add_metric([self.model, engine], float(getattr(s, field)))
            yield g
        for name, field, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=_LABELS)
            for engine, s in engines:
                c.add_metric([self.model, engine], float(getattr(s, field)))
            yield c
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*_LABELS, "position"])
        for engine, s in engines:
            for pos, count in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([self.model, engine, str(pos)], float(count))
        yield per_pos
        # An info metric as vLLM writes one: a gauge of 1 whose labels carry the configuration.
        keys = ["block_size", "cache_dtype", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching", "engine"]
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the engine's cache configuration.",
                                 labels=keys)
        for engine, s in engines:
            info.add_metric([str(s.block_size), s.kv_cache_dtype or "auto", str(s.num_kv_blocks),
                             str(s.num_cpu_blocks), str(s.enable_prefix_caching), engine], 1.0)
        yield info
        # The bridge's own measurements are the server's, not an engine's: its first engine's label.
        labels = [self.model, engines[0][0]]
        # noria serves no LoRA adapters: none running or waiting, max_lora 0. The value is the
        # time of the reading, as vLLM's (a reader takes the newest series).
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        lora.add_metric(["0", "", ""], time.time())
        yield lora
        hists = ((self.ttft, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
                 (self.itl, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
                 (self.itl, "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds. "
                  "DEPRECATED: use vllm:inter_token_latency_seconds."),
                 (self.e2e, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
                 (self.prompt_len, "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
                 (self.output_len, "vllm:request_generation_tokens", "Number of generation tokens processed."))
        for hist, name, doc in hists:
            if hist is not None:
                yield _mirror_histogram(name, doc, hist, labels)
        if self.success is not None:
            yield _mirror_by_reason("vllm:request_success", "Count of successfully processed requests.",
                                    self.success, labels)
