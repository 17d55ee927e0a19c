"""The planner's moves (block copies between the device and the host) carried out through the
runner, in the order they were decided: a copy out reads a block before a later copy in writes
it, and host slots are given back before a later copy takes them. A failed copy is reported
back; whatever its fallback decides is carried out next."""

import logging

from app.engine.host_tier import HostDrop, HostLoad, HostSave
from app.engine.schedule import Reload, Spill

log = logging.getLogger("spool.engine")


def carry_out(planner, runner, moves: list) -> int:
    """Returns how many host-tier loads were carried out (their requests can be planned now)."""
    loads = 0
    while moves:
        for move in moves:
            carry(planner, runner, move)
            loads += isinstance(move, HostLoad)
        moves = planner.take_moves()
    return loads


def carry(planner, runner, move) -> None:
    if isinstance(move, Spill):
        try:
            host_copy = runner.save_blocks(move.block_ids)
            state = None if move.state_slot is None else runner.save_state(move.state_slot)
        except Exception:
            planner.spill_failed(move)
        else:
            planner.spill_saved(move, host_copy, state)
    elif isinstance(move, Reload):
        try:
            runner.load_blocks(move.block_ids, move.host_copy)
            if move.state_slot is not None:
                runner.load_state(move.state_slot, move.state)
        except Exception:
            planner.reload_failed(move)
        runner.drop_spill(move.host_copy)
    elif isinstance(move, HostSave):
        try:
            move.entry.data = runner.save_blocks([move.block])
        except Exception as e:
            log.warning(f"a prefix block could not be saved to the host: {type(e).__name__}: {e}")
            planner.host_save_failed(move)
    elif isinstance(move, HostLoad):
        ok = False
        if move.entry.data is not None and planner.host_load_wanted(move):
            try:
                runner.load_blocks([move.block], move.entry.data)
                ok = True
            except Exception as e:
                log.warning(f"a prefix block could not be loaded from the host: {type(e).__name__}: {e}")
        drop(runner, move.entry)
        planner.host_loaded(move, ok)
    elif isinstance(move, HostDrop):
        drop(runner, move.entry)


def drop(runner, entry) -> None:
    if entry.data is not None:
        runner.drop_spill(entry.data)
        entry.data = None
