"""What the planner decides and the engine carries out: the step, and the K/V blocks to copy.
Data only: the engine copies blocks through the runner and reports a failed copy back."""

from dataclasses import dataclass

from app.engine.request import Request
from model.runner import StepPlan


@dataclass
class Spill:
    """Copy a preempted request's blocks to the host, before a step may reuse them."""

    request: Request
    block_ids: list[int]


@dataclass
class Reload:
    """Copy a resumed request's host copy into fresh blocks; then the host copy is dropped."""

    request: Request
    block_ids: list[int]
    host_copy: object


@dataclass
class TickStart:
    """Planner.start_tick(): done before the step is planned."""

    retired: list[Request]  # gone, blocks freed; each one's host copy (request.spilled) is the engine's to drop
    reloads: list[Reload]  # their requests decode in the coming step


@dataclass
class Schedule:
    """Planner.schedule(): the spills are copied out before the step is launched."""

    step: StepPlan | None  # None: only preemption would make room while a step runs
    spills: list[Spill]
