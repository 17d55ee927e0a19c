"""What the engine counts for /metrics: counters, and fixed-bucket latency histograms with
vLLM's meanings. Plain numbers here; the server turns them into Prometheus text."""

import bisect
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass
class Histogram:
    buckets: tuple = LATENCY_BUCKETS
    counts: list = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))  # last: +Inf
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass
class Stats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_host_hits: int = 0  # of those, loaded from the prefix cache's host tier
    preemptions: int = 0
    finished: Counter = field(default_factory=Counter)  # finish_reason -> count
    time_to_first_token: Histogram = field(default_factory=Histogram)
    inter_token_latency: Histogram = field(default_factory=Histogram)
    time_per_output_token: Histogram = field(default_factory=Histogram)  # per request: decode time / (tokens - 1)
    e2e_request_latency: Histogram = field(default_factory=Histogram)
    request_queue_time: Histogram = field(default_factory=Histogram)

    def token(self, request, now: float) -> None:
        """One token sampled for request at time now."""
        self.generation_tokens += 1
        if request.output.first_token_at is None:
            self.time_to_first_token.observe(now - request.arrival)
        else:
            self.inter_token_latency.observe(now - request.output.last_token_at)

    def request_done(self, request, now: float) -> None:
        scheduled, output = request.schedule, request.output
        self.finished[scheduled.finish_reason] += 1
        self.e2e_request_latency.observe(now - request.arrival)
        if scheduled.scheduled_at is not None:
            self.request_queue_time.observe(scheduled.scheduled_at - request.arrival)
        if output.first_token_at is not None and len(request.output_ids) > 1:
            self.time_per_output_token.observe(
                (output.last_token_at - output.first_token_at) / (len(request.output_ids) - 1))
