"""Prometheus metrics, one registry per app (so several apps in one process, as in tests, do not collide):
codespec's own (codespec_*), and llama-server's names (llamacpp:*) for those codespec can fill, so dashboards made
for llama-server read it."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    def __init__(self, scheduler):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("codespec_requests", "HTTP requests, by route and status code",
                                ["route", "status"], registry=registry)
        self.latency = Histogram("codespec_request_seconds", "HTTP request time, to the last byte, by route",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.first_token = Histogram("codespec_time_to_first_token_seconds",
                                     "time from a generation's arrival to its first token, queue wait included",
                                     ["route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_wait = Histogram("codespec_queue_wait_seconds", "time a generation waited before its first step",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("codespec_prompt_tokens", "prompt tokens received", registry=registry)
        self.cached_tokens = Counter("codespec_prompt_tokens_cached", "prompt tokens reused from a session's cache",
                                     registry=registry)
        self.generated_tokens = Counter("codespec_generated_tokens", "tokens generated", ["route"], registry=registry)
        self.forwards = Counter("codespec_target_forwards", "forwards of the target model", registry=registry)
        self.drafted = Counter("codespec_draft_tokens", "draft tokens verified, by drafter", ["drafter"],
                               registry=registry)
        self.accepted = Counter("codespec_draft_tokens_accepted", "draft tokens accepted, by drafter", ["drafter"],
                                registry=registry)
        self.acceptance = Gauge("codespec_draft_acceptance_ratio", "accepted / drafted tokens so far, by drafter",
                                ["drafter"], registry=registry)
        self.cancelled = Counter("codespec_cancelled", "generations cancelled (client gone or a limit hit)",
                                 registry=registry)
        queue = Gauge("codespec_queue_depth", "generations waiting to start", registry=registry)
        queue.set_function(lambda: scheduler.queued)
        active = Gauge("codespec_active_generations", "generations taking turns on the engine", registry=registry)
        active.set_function(lambda: scheduler.active)
        ticks = Gauge("codespec_batched_forwards", "forwards the scheduler ran, each for every active generation",
                      registry=registry)
        ticks.set_function(lambda: scheduler.ticks)
        shared = Gauge("codespec_shared_forwards", "of those, forwards over more than one generation's rows",
                       registry=registry)
        shared.set_function(lambda: scheduler.batched_ticks)
        self.pool_occupancy = Gauge("codespec_pool_occupancy", "share of the shared ngram-mod pool's slots in use",
                                    registry=registry)
        self.sessions = Gauge("codespec_sessions", "named sessions held", registry=registry)
        self.session_bytes = Gauge("codespec_session_cache_bytes", "KV-cache bytes held by named sessions",
                                   registry=registry)
        # what the text can depend on: 1 where a token's numbers are the same whatever chunk, batch or cached prefix
        # it came with (--invariant on, on the CPU's numba path), so greedy text does not depend on load or history
        invariant = Gauge("codespec_batch_invariant", "1: greedy text independent of load and session history "
                          "(--invariant on, per-row kernels); 0: prompt chunks in kernels whose bits depend on the "
                          "chunk", registry=registry)
        invariant.set_function(lambda: float(bool(getattr(scheduler.engine.path, "invariant", False))))
        # every step priced (adaptive.DraftingCosts): what the host and each drafter's call cost per step here
        host = Gauge("codespec_step_host_seconds", "a step's host time outside the forward and the drafters' calls "
                     "(learnt, fading)", registry=registry)
        host.set_function(lambda: scheduler.engine.drafting.host)
        self.call_seconds = Gauge("codespec_drafter_call_seconds", "seconds one call of a drafter's draft() costs "
                                  "(learnt, fading), by drafter", ["drafter"], registry=registry)
        self._drafting = lambda: scheduler.engine.drafting.calls
        self._totals: dict[str, list[int]] = {}
        self.llama = LlamaTotals()
        registry.register(LlamaCppCollector(self.llama, scheduler))

    def observe_generation(self, route: str, stats, drafters=()) -> None:
        """Count one generation's tokens and each drafter's drafted/accepted tokens."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.generated_tokens.labels(route).inc(stats.generated_tokens)
        self.forwards.inc(stats.target_forwards)
        self.llama.add(stats)
        for drafter in drafters:
            self.drafted.labels(drafter.name).inc(drafter.gen_tokens)
            self.accepted.labels(drafter.name).inc(drafter.acc_tokens)
            totals = self._totals.setdefault(drafter.name, [0, 0])
            totals[0] += drafter.gen_tokens
            totals[1] += drafter.acc_tokens
            self.acceptance.labels(drafter.name).set(totals[1] / totals[0] if totals[0] else 0.0)
        for drafter, seconds in list(self._drafting().items()):
            self.call_seconds.labels(drafter).set(seconds)


@dataclass
class LlamaTotals:
    """What llama-server's counters count, summed over generations (warm-ups included: their prompts count)."""

    prompt_tokens: int = 0  # prompt tokens computed (not reused from a cache)
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    n_tokens_max: int = 0  # the most tokens of context one generation used

    def add(self, stats) -> None:
        self.prompt_tokens += stats.prompt_tokens - stats.cached_tokens
        self.prompt_seconds += stats.prefill_seconds
        self.predicted_tokens += stats.generated_tokens
        self.predicted_seconds += max(stats.seconds - stats.prefill_seconds, 0.0)
        self.draft_tokens += stats.drafted_tokens
        self.accepted_tokens += stats.accepted_tokens
        self.n_tokens_max = max(self.n_tokens_max, stats.prompt_tokens + stats.generated_tokens)


class LlamaCppCollector:
    """llama-server's metric names (its /metrics), read at each scrape: prompt and predicted tokens and seconds,
    their average rates, the requests generating and waiting, the forwards run (llama_decode calls), the draft
    tokens verified and accepted."""

    def __init__(self, totals: LlamaTotals, scheduler):
        self.totals, self.scheduler = totals, scheduler

    def collect(self):
        t, scheduler = self.totals, self.scheduler
        counters = (("prompt_tokens", "Number of prompt tokens processed.", t.prompt_tokens),
                    ("prompt_seconds", "Prompt process time", t.prompt_seconds),
                    ("tokens_predicted", "Number of generation tokens processed.", t.predicted_tokens),
                    ("tokens_predicted_seconds", "Predict process time", t.predicted_seconds),
                    ("n_decode", "Total number of llama_decode() calls (codespec: batched forwards)",
                     scheduler.ticks),
                    ("spec_decode_num_draft_tokens", "Total draft tokens generated", t.draft_tokens),
                    ("spec_decode_num_accepted_tokens", "Total draft tokens accepted by the target model",
                     t.accepted_tokens))
        for name, doc, value in counters:
            yield CounterMetricFamily(f"llamacpp:{name}", doc, value=value)
        gauges = (("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                   t.prompt_tokens / t.prompt_seconds if t.prompt_seconds else 0.0),
                  ("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                   t.predicted_tokens / t.predicted_seconds if t.predicted_seconds else 0.0),
                  ("requests_processing", "Number of requests processing.", scheduler.active),
                  ("requests_deferred", "Number of requests deferred.", scheduler.queued),
                  ("n_tokens_max", "Largest observed n_tokens.", t.n_tokens_max))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"llamacpp:{name}", doc, value=value)
