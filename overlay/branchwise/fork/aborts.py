"""Ending parked parents from outside the stream: aborts, and the idle leak check."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import TYPE_CHECKING

from branchwise.fork.lifecycle import finish_outside_batch
from branchwise.fork.phases import Stage

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import BaseFinishReason

    from branchwise.fork.manager import ForkManager, Track

logger = logging.getLogger("branchwise.fork")
ORPHAN_MESSAGE = "Branchwise: a parked request lost its branches; freed by the idle leak check"


def end_parked(mgr: ForkManager, track: Track, reason: BaseFinishReason) -> None:
    track.req.finished_reason = reason
    finish_outside_batch(mgr, track)


def abort_parked(mgr: ForkManager, recv_req: AbortReq) -> None:
    """SGLang's abort matched rids by prefix over its queues and batches; parked parents are in neither."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    hit = [phase for phase in mgr.parked() if recv_req.abort_all or phase.parent_rid.startswith(recv_req.rid)]
    if not hit:
        return
    before, msg = len(mgr.parked()), recv_req.abort_message
    for phase in hit:
        if phase.state is Stage.PARALLEL:  # not released with an enclosing phase aborted before it
            reason = FINISH_ABORT(msg, HTTPStatus.SERVICE_UNAVAILABLE) if msg else FINISH_ABORT()
            end_parked(mgr, phase.owner, reason)
    mgr.stats["parked_aborted"] += before - len(mgr.parked())


def idle(mgr: ForkManager) -> bool:
    """SGLang's scheduler holds no request: free orphaned parked parents. Whether Branchwise is
    idle too (nothing parked and no park or join for the next scheduling point)."""
    if not mgr.busy():
        return True
    if mgr.pending():
        return False  # the next scheduling point parks, spawns or joins
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for phase in mgr.parked():
        if phase.state is not Stage.PARALLEL or phase.depth:
            continue  # a nested parent goes with its root, which is parked too
        lost = [branch.rid for branch in phase.branches if not branch.finished]
        logger.error("Branchwise leak check: request %s is parked on branches %s that no scheduler queue "
                     "holds; freed (prefix pin released, request ended with an error)",
                     phase.parent_rid, lost)
        end_parked(mgr, phase.owner, FINISH_ABORT(ORPHAN_MESSAGE, HTTPStatus.INTERNAL_SERVER_ERROR))
        mgr.stats["orphans_freed"] += 1
        if mgr.metrics is not None:
            mgr.metrics.orphans.inc()
    return not mgr.busy()
