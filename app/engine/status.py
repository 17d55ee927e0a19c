"""Operator status lines in SGLang's format, with decode throughput since the last line."""

import time


class StatusReporter:
    def __init__(self, decode_interval: int = 40):
        self.decode_interval = decode_interval
        self.steps = 0
        self.tokens_at_last_line = 0
        self.since = time.monotonic()

    @staticmethod
    def prefill_line(admitted, planner, pool) -> str:
        return (f"Prefill batch. #new-seq: {admitted.seqs}, #new-token: {admitted.new_tokens},"
                f" #cached-token: {admitted.cached_tokens}, token usage: {pool.usage:.2f},"
                f" #running-req: {planner.num_running}, #queue-req: {len(planner.waiting)}")

    def decode_step(self, planner, pool) -> str | None:
        """Count one step; every decode_interval steps, return a Decode line."""
        self.steps += 1
        if not self.decode_interval or self.steps % self.decode_interval:
            return None
        now = time.monotonic()
        tokens = planner.stats.generation_tokens
        rate = (tokens - self.tokens_at_last_line) / max(now - self.since, 1e-9)
        self.tokens_at_last_line, self.since = tokens, now
        held = sum(r.num_tokens for r in planner.requests.values())
        line = (f"Decode batch. #running-req: {planner.num_running}, #token: {held},"
                f" token usage: {pool.usage:.2f}, gen throughput (token/s): {rate:.2f},"
                f" #queue-req: {len(planner.waiting)}")
        if planner.speculation:  # as SGLang's line: the share of guesses kept, tokens per verified row
            s = planner.speculation.stats
            line += (f", accept rate: {s.accepted_tokens / max(s.draft_tokens, 1):.2f},"
                     f" accept len: {1 + s.accepted_tokens / max(s.drafts, 1):.2f}")
        return line
