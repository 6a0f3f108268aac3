"""The server's Prometheus metrics (``GET /metrics``), in a registry of each server's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..api import GenerationResult

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


class Metrics:
    """Counters, gauges and histograms of one server, named ``fsd_eagle_*``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fsd_eagle_requests", "Requests (choices) by how they ended", ["status"], registry=r)
        self.prompt_tokens = Counter("fsd_eagle_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("fsd_eagle_generation_tokens", "Tokens generated", registry=r)
        self.target_forwards = Counter("fsd_eagle_target_forwards",
                                       "Target forwards counted per request (a batched round counts once per row)",
                                       registry=r)
        self.fuzzy_accepted = Counter("fsd_eagle_fuzzy_accepted_tokens",
                                      "Tokens accepted by the fuzzy test that exact verification would reject",
                                      registry=r)
        self.rounds = Counter("fsd_eagle_rounds", "Decoding rounds run (one target forward for every row)",
                              registry=r)
        self.tau = Histogram("fsd_eagle_request_tau", "New tokens per target forward of finished requests",
                             buckets=TAU_BUCKETS, registry=r)
        self.queue_depth = Gauge("fsd_eagle_queue_depth", "Requests waiting for a row", registry=r)
        self.running_rows = Gauge("fsd_eagle_running_rows", "Rows decoding a request", registry=r)
        self.peak_running_rows = Gauge("fsd_eagle_peak_running_rows", "Most rows decoding at once so far",
                                       registry=r)
        self.time_to_first_token = Histogram("fsd_eagle_time_to_first_token_seconds",
                                             "From a request's arrival to its first token", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.inter_token_latency = Histogram("fsd_eagle_inter_token_latency_seconds",
                                             "Time between a request's tokens (a round's tokens share its time)",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.compiled_sessions = Gauge("fsd_eagle_compiled_sessions",
                                       "Configurations (rule form, batch bucket) decoding on compiled rounds",
                                       registry=r)
        self.compile_seconds = Counter("fsd_eagle_compile_seconds",
                                       "Time spent making compiled sessions beside serving", registry=r)
        self._peak = 0

    def count_result(self, prompt_tokens: int, result: GenerationResult) -> None:
        s = result.stats
        self.requests.labels(status="ok").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(s.new_tokens)
        self.target_forwards.inc(s.target_forwards)
        self.fuzzy_accepted.inc(s.fuzzy_accepted)
        if s.target_forwards:
            self.tau.observe(s.tau)

    def set_running(self, rows: int) -> None:
        self.running_rows.set(rows)
        if rows > self._peak:
            self._peak = rows
            self.peak_running_rows.set(rows)
