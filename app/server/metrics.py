"""GET /metrics: the engine's own counters and histograms in Prometheus text, under vLLM's
metric names with a `spool:` prefix, the listener's connections, and the standard process_*
metrics (resident memory, CPU time, open files: what a soak watches for leaks). Collectors
read them at scrape time, so nothing is counted twice."""

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from app.server.http.listener import CLOSE_REASONS

HISTOGRAMS = {
    "time_to_first_token_seconds": ("time_to_first_token", "Time to first token."),
    "inter_token_latency_seconds": ("inter_token_latency", "Time between consecutive tokens of a request."),
    "time_per_output_token_seconds": ("time_per_output_token", "Per request: decode time per output token."),
    "e2e_request_latency_seconds": ("e2e_request_latency", "End-to-end request latency."),
    "request_queue_time_seconds": ("request_queue_time", "Time from arrival to admission."),
}


class EngineCollector:
    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        status = self.engine.status()
        stats = status["stats"]
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"spool:{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"spool:{name}", doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Requests prefilling or decoding.", status["num_requests_running"])
        yield gauge("num_requests_waiting", "Requests waiting, queued or preempted.", status["num_requests_waiting"])
        yield gauge("kv_cache_usage_perc", "Share of KV blocks in use (1 is full).", status["kv_cache_usage_perc"])
        yield counter("prompt_tokens", "Prompt tokens admitted.", stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.prefix_cache_hits)
        yield counter("prefix_cache_host_hits", "Of those, tokens loaded back from its host tier (--swap-space).",
                      stats.prefix_cache_host_hits)
        yield counter("num_preemptions", "Requests preempted for KV space.", stats.preemptions)
        speculation = self.engine.planner.speculation
        if speculation:  # vLLM's spec_decode counters
            spec = speculation.stats
            yield counter("spec_decode_num_drafts", "Decode rows that carried guesses.", spec.drafts)
            yield counter("spec_decode_num_draft_tokens", "Guessed tokens verified.", spec.draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Guessed tokens kept.", spec.accepted_tokens)
            per_pos = CounterMetricFamily("spool:spec_decode_num_accepted_tokens_per_pos",
                                          "Guessed tokens kept, by their place in the row's guesses.",
                                          labels=labels + ["position"])
            for position, kept in enumerate(spec.accepted_per_pos):
                per_pos.add_metric(values + [str(position)], kept)
            yield per_pos
        success = CounterMetricFamily("spool:request_success", "Finished requests by finish reason.",
                                      labels=labels + ["finished_reason"])
        for reason in ("stop", "length", "cancelled", "error"):
            success.add_metric(values + [reason], stats.finished[reason])
        yield success
        for name, (attr, doc) in HISTOGRAMS.items():
            h = getattr(stats, attr)
            cumulative, buckets = 0, []
            for bound, count in zip([*h.buckets, float("inf")], h.counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            family = HistogramMetricFamily(f"spool:{name}", doc, labels=labels)
            family.add_metric(values, buckets, h.total)
            yield family


class ConnectionCollector:
    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        yield GaugeMetricFamily("spool:connections_open", "Client connections open now.", value=self.stats.open)
        closed = CounterMetricFamily("spool:connections_closed", "Client connections closed, by why they closed.",
                                     labels=["reason"])
        for reason in CLOSE_REASONS:
            closed.add_metric([reason], self.stats.closed[reason])
        yield closed


class ServerInfo:
    """spool:server_info{model_name, backend} 1: what the chat page's header shows."""

    def __init__(self, model_name: str, backend: str):
        self.labels = [model_name, backend]

    def collect(self):
        info = GaugeMetricFamily("spool:server_info", "The served model and the numerics backend.",
                                 labels=["model_name", "backend"])
        info.add_metric(self.labels, 1)
        yield info


def render(engine, model_name: str, backend: str, connections) -> tuple[bytes, str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    registry.register(ServerInfo(model_name, backend))
    registry.register(ConnectionCollector(connections))
    ProcessCollector(registry=registry)
    return generate_latest(registry), CONTENT_TYPE_LATEST
