"""Operator status lines in SGLang's format, with decode throughput since the last line."""

import time

from app.engine.schedule import Admitted, PlannerView


class StatusReporter:
    def __init__(self, decode_interval: int, pool, stats, speculation=None):
        self.decode_interval = decode_interval
        self.pool, self.stats, self.speculation = pool, stats, speculation
        self.steps = 0
        self.tokens_at_last_line = 0
        self.since = time.monotonic()

    def prefill_line(self, admitted: Admitted, planner: PlannerView) -> str:
        return (f"Prefill batch. #new-seq: {admitted.seqs}, #new-token: {admitted.new_tokens},"
                f" #cached-token: {admitted.cached_tokens}, token usage: {self.pool.usage:.2f},"
                f" #running-req: {planner.running}, #queue-req: {planner.waiting}")

    def decode_due(self) -> bool:
        """Count one step; True every decode_interval steps, when a Decode line is due."""
        self.steps += 1
        return bool(self.decode_interval) and not self.steps % self.decode_interval

    def decode_line(self, planner: PlannerView, held_tokens: int) -> str:
        now = time.monotonic()
        tokens = self.stats.generation_tokens
        rate = (tokens - self.tokens_at_last_line) / max(now - self.since, 1e-9)
        self.tokens_at_last_line, self.since = tokens, now
        line = (f"Decode batch. #running-req: {planner.running}, #token: {held_tokens},"
                f" token usage: {self.pool.usage:.2f}, gen throughput (token/s): {rate:.2f},"
                f" #queue-req: {planner.waiting}")
        if self.speculation:  # as SGLang's line: the share of guesses kept, tokens per verified row
            s = self.speculation.stats
            line += (f", accept rate: {s.accepted_tokens / max(s.draft_tokens, 1):.2f},"
                     f" accept len: {1 + s.accepted_tokens / max(s.drafts, 1):.2f}")
        return line
