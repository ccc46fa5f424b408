"""The server's Prometheus metrics (``GET /metrics``), through ``prometheus_client``.

Every ``ServerMetrics`` has its own ``CollectorRegistry``, so several apps in one
process (tests) never clash in the library's global registry. The engine thread
writes them (the library's metrics are thread-safe); ``/metrics`` reads them.

Two families describe the same events:

vLLM's names (``vllm:``-prefixed, labelled ``model_name`` = the served model name and
``engine`` = "0", as vLLM labels them), so that vLLM's Grafana dashboards and alerts
read this server as they read vLLM:

- gauges: ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``
  (KV blocks held / blocks in the pool, 0..1);
- counters: ``prompt_tokens`` (admitted), ``generation_tokens`` (every token the engine
  generated, an aborted request's included), ``request_success{finished_reason}`` (per
  completion; ``abort`` for a client's abort), ``num_preemptions``,
  ``prefix_cache_queries`` / ``prefix_cache_hits`` (prompt tokens looked up / found in
  the prefix cache);
- histograms, per completion: ``time_to_first_token_seconds``, ``e2e_request_latency_seconds``
  (arrival to finish), ``request_queue_time_seconds`` (arrival to the start of the step
  that first scheduled it), ``request_time_per_output_token_seconds`` ((last - first
  token time) / (tokens - 1)), ``request_prompt_tokens``, ``request_generation_tokens``;
  and ``inter_token_latency_seconds``: one observation per token after a completion's
  first, the time since the token before. A streamed completion's tokens arrive step by
  step; a non-streamed one's arrive at its end, and its gaps are observed as the mean
  gap (vLLM sees every step of both).

Ours (``minivllm_``-prefixed, unlabelled):

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

import bisect
import math
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from minivllm.outputs import FinishReason

if TYPE_CHECKING:
    from minivllm.server.engine_loop import StepCounts

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# vLLM's buckets, so that quantiles over both servers agree.
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's 1-2-5 series (it stops at max_model_len; these go past any context length).
_VLLM_TOKEN_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))
VLLM_ENGINE_LABEL = "0"  # vLLM numbers its engine cores; this server has one


class WeightedHistogram:
    """A labelled Prometheus histogram that takes ``count`` equal observations in one call.

    The engine thread observes the inter-token gaps of every running completion each step,
    most of them equal (one step apart): ``observe(gap, count)`` records them at the cost of
    one, where ``prometheus_client.Histogram`` takes a call (and a lock) per observation.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 labels: dict[str, str], registry: CollectorRegistry) -> None:
        self._name, self._documentation, self._labels = name, documentation, dict(labels)
        self._bounds = tuple(float(b) for b in buckets) + (math.inf,)
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """Record ``count`` observations of ``value``."""
        i = bisect.bisect_left(self._bounds, value)  # the first bucket whose le >= value
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        cumulative, buckets = 0, []
        for bound, n in zip(self._bounds, counts):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))  # "+Inf" last
        family.add_metric(list(self._labels.values()), buckets, total)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))


class VllmMetrics:
    """vLLM's metrics under vLLM's names and labels (see the module docstring)."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        labels = {"model_name": model_name, "engine": VLLM_ENGINE_LABEL}
        names, values, r = list(labels), list(labels.values()), registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge("vllm:" + name, doc, names, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter("vllm:" + name, doc, names, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram("vllm:" + name, doc, names, buckets=buckets, registry=r).labels(*values)

        self.running = gauge("num_requests_running", "Sequences in the running queue.")
        self.waiting = gauge("num_requests_waiting",
                             "Sequences waiting to be scheduled, and requests not admitted yet.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc",
                                    "KV cache blocks held by sequences / blocks in the pool (0..1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens",
                                         "Completion tokens generated, aborted requests' included.")
        self.preemptions = counter("num_preemptions", "Sequences preempted.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter("vllm:request_success", "Completions finished, by finish reason.",
                          names + ["finished_reason"], registry=r)
        # Every reason from the start, as vLLM does: a dashboard's rate() sees a zero first.
        self.success = {reason: success.labels(*values, reason) for reason in get_args(FinishReason)}
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first token, per completion.",
                              _VLLM_TTFT_BUCKETS)
        self.itl = WeightedHistogram("vllm:inter_token_latency_seconds",
                                     "Time from a token to the next, per token after a completion's first.",
                                     _VLLM_TOKEN_LATENCY_BUCKETS, labels, r)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "(last - first token time) / (tokens - 1), per completion.",
                              _VLLM_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the end, per completion.",
                             _VLLM_REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to the start of the step that first scheduled it, per completion.",
                                    _VLLM_REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens, per completion.",
                                               _VLLM_TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Completion tokens, per completion.", _VLLM_TOKEN_COUNT_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Rows scored with draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens scored.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._per_position = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by their position in the drafts (0: the first).",
                                     names + ["position"], registry=r)
        self._values = values
        self.spec_accepted_per_position: list[Counter] = []

    def accepted_at(self, position: int) -> Counter:
        """The counter of drafts accepted at ``position`` (0: the first), made when first met."""
        while len(self.spec_accepted_per_position) <= position:
            self.spec_accepted_per_position.append(
                self._per_position.labels(*self._values, str(len(self.spec_accepted_per_position))))
        return self.spec_accepted_per_position[position]


class ServerMetrics:
    """The Prometheus metrics of one server, in their own registry.

    Args:
        model_name: the served model name (vLLM's ``model_name`` label).
    """

    def __init__(self, model_name: str = "minivllm") -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, "minivllm_"
        self.model_name = model_name
        self.vllm = VllmMetrics(model_name, r)
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
        # The engine's running totals at the last step: steps, cached tokens, computed
        # prefill tokens, preemptions, drafts, draft tokens, accepted tokens.
        self._totals = (0, 0, 0, 0, 0, 0, 0)
        self._per_position: tuple[int, ...] = ()  # accepted drafts by position, as last seen

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    # ---- what the engine thread records -----------------------------------------

    def step(self, now: StepCounts) -> None:
        """Record an engine step; the running totals advance the counters by their growth."""
        totals = (now.steps, now.cached_tokens, now.computed_prefill_tokens, now.preemptions,
                  now.drafts, now.draft_tokens, now.accepted_tokens)
        steps, hits, computed, preempted, drafts, drafted, accepted = (a - b for a, b in zip(totals, self._totals))
        self._totals = totals
        v = self.vllm
        if drafts:
            v.spec_drafts.inc(drafts)
            v.spec_draft_tokens.inc(drafted)
            v.spec_accepted_tokens.inc(accepted)
            for i, n in enumerate(now.accepted_per_position):
                grown = n - (self._per_position[i] if i < len(self._per_position) else 0)
                if grown:
                    v.accepted_at(i).inc(grown)
            self._per_position = now.accepted_per_position
        for ours, theirs, value in ((self.running, v.running, now.running),
                                    (self.waiting, v.waiting, now.waiting)):
            ours.set(value)
            theirs.set(value)
        self.blocks_used.set(now.blocks_used)
        self.blocks_total.set(now.blocks_total)
        v.kv_cache_usage.set(now.blocks_used / now.blocks_total if now.blocks_total else 0.0)
        if now.batch_size:
            self.batch_size.observe(now.batch_size)
        self.steps.inc(steps)
        self.cache_hits.inc(hits)
        v.prefix_cache_hits.inc(hits)
        v.prefix_cache_queries.inc(hits + computed)
        self.preemptions.inc(preempted)
        v.preemptions.inc(preempted)
        needed = now.cached_tokens + now.computed_prefill_tokens
        self.hit_rate.set(now.cached_tokens / needed if needed else 0.0)

    def admitted(self, prompt_lens: Sequence[int]) -> None:
        """Requests admitted, one per prompt of these lengths."""
        self.requests.inc(len(prompt_lens))
        total = sum(prompt_lens)
        self.prompt_tokens.inc(total)
        self.vllm.prompt_tokens.inc(total)

    def generated(self, num_tokens: int) -> None:
        """Tokens the engine generated (delivered, or of an aborted request)."""
        self.generation_tokens.inc(num_tokens)
        self.vllm.generation_tokens.inc(num_tokens)

    def queued(self, seconds: float) -> None:
        """A completion's time from arrival to its first scheduling."""
        self.vllm.queue_time.observe(seconds)

    def first_token(self, seconds: float) -> None:
        """A completion's time to first token."""
        self.ttft.observe(seconds)
        self.vllm.ttft.observe(seconds)

    def inter_token(self, seconds: float, count: int) -> None:
        """``count`` inter-token gaps of ``seconds`` each."""
        self.vllm.itl.observe(seconds, count)

    def finished_completion(self, reason: FinishReason, e2e: float, num_prompt_tokens: int,
                            num_tokens: int, time_per_output_token: float | None) -> None:
        """A completion ended (``abort``: by its client): its latency and sizes;
        ``time_per_output_token`` None when it has fewer than two tokens."""
        v = self.vllm
        self.finished.labels(finish_reason=reason).inc()
        v.success[reason].inc()
        v.e2e.observe(e2e)
        v.request_prompt_tokens.observe(num_prompt_tokens)
        v.request_generation_tokens.observe(num_tokens)
        if time_per_output_token is not None:
            self.tpot.observe(time_per_output_token)
            v.tpot.observe(time_per_output_token)
