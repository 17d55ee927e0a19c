"""What the planner decides and the engine carries out (the step, the K/V blocks to copy), and
what the engine reads of it. Data only: the engine copies blocks through the runner and reports
a failed copy back."""

from dataclasses import dataclass

from app.engine.request import Request
from model.runner import StepPlan


@dataclass
class Spill:
    """Copy a preempted request's blocks to the host, before a step may reuse them."""

    request: Request
    block_ids: list[int]
    state_slot: int | None = None  # a hybrid's: its delta-net state goes to the host too


@dataclass
class Reload:
    """Copy a resumed request's host copy into fresh blocks; then the host copy is dropped."""

    request: Request
    block_ids: list[int]
    host_copy: object
    state_slot: int | None = None  # a hybrid's fresh slot, and the state copied out with the blocks
    state: object = None


@dataclass
class TickStart:
    """Planner.start_tick(): done before the step is planned."""

    retired: list[Request]  # gone, blocks freed; each one's host copy (schedule.spilled) is the engine's to drop
    moves: list  # Reloads (their requests decode in the coming step) and the host tier's moves, in order


@dataclass
class Schedule:
    """Planner.schedule(): the moves are carried out, in order, before the step is launched."""

    step: StepPlan | None  # None: only preemption would make room while a step runs
    moves: list  # Spills and the host tier's moves
    requests: list[Request]  # of each of the step's rows, in order: the engine adds their masks


@dataclass
class Admitted:
    """What ticks admitted since the last Prefill status line, counted at admission."""

    seqs: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class PlannerView:
    """The planner as the engine reads it: where its requests are, counted, for admission,
    status() and the log lines, and the decoding ones, in the order their deltas go out."""

    running: int  # prefilling or decoding
    waiting: int  # queued, not admitted yet
    preempted: int  # waiting to resume
    decoding: tuple[Request, ...]
