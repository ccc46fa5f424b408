"""The server's Prometheus metrics (``GET /metrics``), through ``prometheus_client``.

Every ``ServerMetrics`` has its own ``CollectorRegistry``, so several apps in one
process (tests) never clash in the library's global registry. The engine thread
writes them (the library's metrics are thread-safe); ``/metrics`` reads them.

Names (all ``minivllm_``-prefixed):

- gauges: ``requests_running``, ``requests_waiting`` (scheduler queue + not yet
  admitted), ``kv_blocks_used``, ``kv_blocks_total``, ``prefix_cache_hit_rate``
  (cached / (cached + computed) prompt tokens, over the server's life);
- counters: ``requests_total`` (admitted), ``requests_finished_total{finish_reason}``,
  ``requests_aborted_total`` (by their client), ``prompt_tokens_total``,
  ``generation_tokens_total``, ``prefix_cache_hit_tokens_total``,
  ``engine_steps_total``, ``preemptions_total``;
- histograms: ``time_to_first_token_seconds`` (admission to the first token,
  per completion), ``time_per_output_token_seconds`` (first to last token over
  tokens - 1, per completion of two or more tokens), ``batch_size`` (sequences
  scheduled per engine step).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class StepCounts:
    """What the engine reported after a step (``ServerMetrics.step``).

    Attributes:
        running / waiting: sequences in the scheduler's queues (+ requests not admitted yet).
        blocks_used / blocks_total: KV blocks held by sequences / in the pool.
        batch_size: sequences scheduled in the step (0: the step only delivered outputs).
        steps, cached_tokens, computed_prefill_tokens, preemptions: the engine's
            running totals (``EngineStats``) after the step.
    """

    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    batch_size: int
    steps: int
    cached_tokens: int
    computed_prefill_tokens: int
    preemptions: int


class ServerMetrics:
    """The Prometheus metrics of one server, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, "minivllm_"
        self.running = Gauge(p + "requests_running", "Sequences in the running queue.", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Sequences waiting to be scheduled.", registry=r)
        self.blocks_used = Gauge(p + "kv_blocks_used", "KV cache blocks held by sequences.", registry=r)
        self.blocks_total = Gauge(p + "kv_blocks_total", "KV cache blocks in the pool.", registry=r)
        self.hit_rate = Gauge(p + "prefix_cache_hit_rate",
                              "Prompt tokens served by the prefix cache / prompt tokens needed.",
                              registry=r)
        self.requests = Counter(p + "requests", "Requests admitted to the engine.", registry=r)
        self.finished = Counter(p + "requests_finished", "Completions finished.",
                                ["finish_reason"], registry=r)
        self.aborted = Counter(p + "requests_aborted", "Requests aborted by their client.", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Completion tokens generated.",
                                         registry=r)
        self.cache_hits = Counter(p + "prefix_cache_hit_tokens",
                                  "Prompt tokens served by the prefix cache.", registry=r)
        self.steps = Counter(p + "engine_steps", "Engine steps run.", registry=r)
        self.preemptions = Counter(p + "preemptions", "Sequences preempted.", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Admission to the first token, per completion.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "(last - first token time) / (tokens - 1), per completion.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(p + "batch_size", "Sequences scheduled per engine step.",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self._last = StepCounts(0, 0, 0, 0, 0, 0, 0, 0, 0)

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def step(self, now: StepCounts) -> None:
        """Record an engine step; the running totals advance the counters by their growth."""
        last, self._last = self._last, now
        self.running.set(now.running)
        self.waiting.set(now.waiting)
        self.blocks_used.set(now.blocks_used)
        self.blocks_total.set(now.blocks_total)
        if now.batch_size:
            self.batch_size.observe(now.batch_size)
        self.steps.inc(now.steps - last.steps)
        self.cache_hits.inc(now.cached_tokens - last.cached_tokens)
        self.preemptions.inc(now.preemptions - last.preemptions)
        needed = now.cached_tokens + now.computed_prefill_tokens
        self.hit_rate.set(now.cached_tokens / needed if needed else 0.0)
