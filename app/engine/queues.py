"""Where every live request is: by id, and in exactly one place by its state. A move takes a
request out of its place and appends it to the next, so the two never disagree."""

from collections import deque

from app.engine.request import Request, State


class Queues:
    def __init__(self):
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.decoding: list[Request] = []
        self.preempted: list[Request] = []
        self.finished: list[Request] = []  # until retired
        self._seq = 0

    def place(self, state: State):
        return {State.WAITING: self.waiting, State.PREFILLING: self.prefilling, State.DECODING: self.decoding,
                State.PREEMPTED: self.preempted, State.FINISHED: self.finished}[state]

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def add(self, request: Request) -> None:
        self._seq += 1
        request.schedule.seq = self._seq
        self.requests[request.id] = request
        self.waiting.append(request)

    def move(self, request: Request, state: State) -> None:
        self.place(request.schedule.state).remove(request)
        request.schedule.state = state
        self.place(state).append(request)

    def started(self, request: Request, target: int) -> None:
        """Its blocks are taken (BlockTables.take): it prefills, or decodes when its whole
        history was cached (a recompute)."""
        self.move(request, State.DECODING if request.schedule.num_computed == target else State.PREFILLING)

    def finish(self, request: Request, reason: str, stop_reason=None, error: str | None = None) -> None:
        """Mark a request done. It leaves, and frees its blocks, in Planner.retire()."""
        self.move(request, State.FINISHED)
        s = request.schedule
        s.finish_reason, s.stop_reason, s.error = reason, stop_reason, error

    def take_finished(self) -> list[Request]:
        """The finished requests, no longer live."""
        finished, self.finished = self.finished, []
        for request in finished:
            del self.requests[request.id]
        return finished
