"""Requests out of the KV cache and back.

When a decode row needs a block and none is free, one victim goes, newest first, never one
resumed within its immunity: spilled to the host pool when it has room (the engine copies its
blocks out before the step that may reuse them), else dropped and later recomputed from its
token history. Preempted requests come back before anything waiting is admitted, fewest blocks
first, with a block of headroom: by reload (the engine copies the host copy into fresh blocks)
or by prefill. A failed spill recomputes; a failed reload re-prefills.

Spills and reloads go on the planner's ordered list of moves, beside the prefix cache's host
tier (host_tier.py), whose entries a spill may evict to get its room.
"""

from app.engine.block_tables import BlockTables
from app.engine.queues import Queues
from app.engine.request import Request, State
from app.engine.schedule import Reload, Spill
from app.engine.stats import Stats


class Preemption:
    def __init__(self, queues: Queues, tables: BlockTables, stats: Stats, max_seqs: int, swap_blocks: int,
                 immunity_tokens: int, moves: list):
        self.queues, self.tables, self.pool = queues, tables, tables.pool
        self.stats = stats  # counts the preemptions
        self.max_seqs = max_seqs
        self.swap_blocks = swap_blocks  # the host spill pool, in blocks; 0: preempt by recompute
        self.immunity_tokens = immunity_tokens  # a resumed request is not preempted again for this many tokens
        self.swap_used = 0
        self.moves = moves  # the planner's, in order: spills and reloads join the host tier's

    def resume(self) -> None:
        """Preempted requests come back first, fewest blocks first, with a block of headroom;
        their host copies are loaded into fresh blocks (a Reload move)."""
        q = self.queues
        for request in sorted(q.preempted, key=lambda r: r.num_tokens):
            if self.outgrew_cache(request):
                continue
            # its next step feeds position num_tokens - 1; one block more of headroom
            headroom = min(self.pool.blocks_for(request.num_tokens) + 1, self.pool.num_blocks)
            if q.num_running >= self.max_seqs or headroom > self.pool.available or not self.tables.slot_free:
                break
            if request.schedule.spilled is not None:
                self.moves.append(self.reload(request))
            elif self.tables.take(request, request.all_ids, request.target):
                q.started(request, request.target)
            else:
                break
            request.schedule.immune_until = len(request.output_ids) + self.immunity_tokens

    def reload(self, request: Request) -> Reload:
        """Its host copy goes back into fresh blocks (the engine copies it before the step)."""
        s = request.schedule
        s.block_table = self.pool.allocate_many(s.spill_blocks)
        if self.tables.slots is not None:  # a hybrid's state goes into a fresh slot
            s.state_slot = self.tables.slots.take()
        reload = Reload(request, s.block_table, s.spilled, s.state_slot, s.spilled_state)
        self.swap_used -= s.spill_blocks
        s.spilled, s.spill_blocks, s.spilled_state = None, 0, None
        self.queues.move(request, State.DECODING)
        return reload

    def outgrew_cache(self, request: Request) -> bool:
        """Its tokens need more blocks than the whole pool has: it ends with an error."""
        if self.pool.blocks_for(request.num_tokens) <= self.pool.num_blocks:
            return False
        self.queues.finish(request, "error", error=f"the request grew to {request.num_tokens} tokens, more"
                           f" than the whole KV cache holds ({self.pool.num_blocks} blocks)")
        return True

    def make_room(self, needy: Request) -> bool:
        """Preempt one victim, newest first, never an immune one (unless only the needy one is
        left). Returns False when the needy request itself had to go."""
        if self.outgrew_cache(needy):
            return False
        candidates = [r for r in self.queues.decoding if len(r.output_ids) >= r.schedule.immune_until]
        victim = max(candidates, key=lambda r: r.schedule.seq) if candidates else needy
        self.preempt(victim)
        return victim is not needy

    def preempt(self, request: Request) -> None:
        """Spilled when the host pool has room (the host tier's entries make way), else
        recomputed from its token history."""
        s = request.schedule
        self.queues.move(request, State.PREEMPTED)
        self.stats.preemptions += 1
        self.tables.offer_full_blocks(request)
        spill_blocks = len(s.block_table)
        host = self.pool.host
        if self.swap_used + spill_blocks <= self.swap_blocks and (host is None or host.make_room(spill_blocks)):
            self.moves.append(Spill(request, s.block_table, s.state_slot))
            s.spill_blocks = spill_blocks
            self.swap_used += spill_blocks
        else:
            s.num_computed = s.num_offered = 0
        self.tables.release(request)

    def spill_saved(self, spill: Spill, host_copy, state=None) -> None:
        spill.request.schedule.spilled, spill.request.schedule.spilled_state = host_copy, state

    def spill_failed(self, spill: Spill) -> None:
        """No host copy: the request recomputes its K/V when it resumes."""
        s = spill.request.schedule
        self.swap_used -= s.spill_blocks
        s.spill_blocks = 0
        s.num_computed = s.num_offered = 0

    def reload_failed(self, reload: Reload) -> None:
        """The host copy did not come back: the request re-prefills its history instead, or
        waits among the preempted when the pool cannot hold it now."""
        request = reload.request
        self.tables.release(request)
        request.schedule.num_computed = request.schedule.num_offered = 0
        if self.tables.take(request, request.all_ids, request.target):
            self.queues.started(request, request.target)
        else:
            self.queues.move(request, State.PREEMPTED)

    def forget(self, request: Request) -> None:
        """A retired request's place in the host pool is free (its copy is the engine's to drop)."""
        self.swap_used -= request.schedule.spill_blocks
        request.schedule.spill_blocks = 0
