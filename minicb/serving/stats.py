"""What the server's `/metrics` shows, through prometheus_client (chapter 08).

vLLM's metrics under minicb's prefix (`vllm:num_requests_running` is
`minicb:num_requests_running`), every one labelled with `model_name`, so a dashboard built for
vLLM reads minicb after a change of prefix; then minicb's own (pages, swap space, lost work,
steps). Each server has its own registry (several can run in one process, as the tests do).
Counters are updated on the engine thread; prometheus_client's metrics are thread-safe."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

PREFIX = "minicb:"
# every finish_reason the engine gives (minicb/request.py says when each happens)
FINISH_REASONS = ("stop", "length", "cancelled", "error", "deadline", "rejected")
disable_created_metrics()  # no `_created` series beside each counter (vLLM turns them off too)
# vLLM's bucket edges, in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

GAUGES = {  # name -> help
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of the KV pages held by requests (0-1).",
    "kv_pages_used": "KV pages held by running requests.",
    "kv_pages_free": "KV pages on the free list.",
    "kv_pages_cached": "Unreferenced KV pages kept by the prefix index.",
    "kv_pages_total": "KV pages in the pool.",
    "kv_swap_pages_free": "Host memory pages free to hold swapped-out K/V.",
    "kv_swap_pages_total": "Host memory pages of swap space (0: preemption mode recompute).",
    "oldest_waiting_seconds": "Queue age: how long the longest-waiting request not yet "
                              "scheduled had waited, as of the engine's last step or command.",
}
COUNTERS = {  # name (exposed with _total) -> help
    "prompt_tokens": "Prompt tokens of the requests accepted.",
    "generation_tokens": "Tokens generated and delivered.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache at admission.",
    "prefix_cache_hits": "Of those, tokens found there (their K/V reused).",
    "num_preemptions": "Preemptions (pages freed; recomputed, or swapped back, later).",
    "steps": "Engine steps run.",
    "preemption_discarded_tokens": "Computed K/V tokens that preemptions threw away.",
    "preemption_recomputed_tokens": "Of those, tokens computed again (the rest came back "
                                    "from the prefix cache).",
    "kv_pages_evicted": "Cached prefix pages given up to make room (reuse lost).",
    "kv_pages_swapped_out": "KV pages copied to host memory by preemptions.",
    "kv_pages_swapped_in": "KV pages copied back from host memory.",
}


class ServerStats:
    """The server's Prometheus metrics for one served model."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}
        self.gauges = {name: Gauge(PREFIX + name, text, **label).labels(model_name)
                       for name, text in GAUGES.items()}
        self.counters = {name: Counter(PREFIX + name, text, **label).labels(model_name)
                         for name, text in COUNTERS.items()}
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        for reason in FINISH_REASONS:  # every reason shows, at 0 until it happens
            self.success.labels(model_name, reason)

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, text, buckets=buckets, **label).labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from arrival to the first token (engine clock).",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between deliveries of tokens to one request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from arrival to the finish, per finished request.",
                             REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Time from arrival to the first step, per finished request "
                               "that was scheduled.", REQUEST_BUCKETS)

    def set_gauges(self, stats: dict[str, int], oldest_waiting_s: float) -> None:
        """The engine's counts now (`Engine.stats()`), and the queue age."""
        used, total = stats["pages_used"], stats["pages_total"]
        values = {"num_requests_running": stats["num_running"],
                  "num_requests_waiting": stats["num_waiting"],
                  "kv_cache_usage_perc": used / total if total else 0.0,
                  "kv_pages_used": used, "kv_pages_free": stats["pages_free"],
                  "kv_pages_cached": stats["pages_cached"], "kv_pages_total": total,
                  "kv_swap_pages_free": stats.get("swap_pages_free", 0),
                  "kv_swap_pages_total": stats.get("swap_pages_total", 0),
                  "oldest_waiting_seconds": oldest_waiting_s}
        for name, value in values.items():
            self.gauges[name].set(value)

    def count(self, name: str, amount: float = 1) -> None:
        """Add to one of `COUNTERS`; a negative amount is skipped (counters only grow)."""
        if amount > 0:
            self.counters[name].inc(amount)

    def finished(self, reason: str, metrics: Any | None) -> None:
        """One request finished with `reason`; its E2E and queue time from its `metrics`
        (a RequestMetrics; None: a request the engine never held)."""
        self.success.labels(self.model_name, reason).inc()
        if metrics is None or metrics.arrival_time is None:
            return
        if metrics.finish_time is not None:
            self.e2e.observe(max(0.0, metrics.finish_time - metrics.arrival_time))
        if metrics.first_scheduled_time is not None:
            self.queue.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))

    def value(self, name: str, **labels: str) -> float | None:
        """The current value of a metric (its name without the prefix; a counter's with or
        without `_total`), as /metrics would show it; None if there is none."""
        labels = {"model_name": self.model_name, **labels}
        for full in (PREFIX + name, PREFIX + name + "_total"):
            value = self.registry.get_sample_value(full, labels)
            if value is not None:
                return value
        return None

    def text(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
