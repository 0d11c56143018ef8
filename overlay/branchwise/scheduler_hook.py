"""Glue into SGLang's Scheduler: per-scheduler Branchwise state and the hook bodies.

Every function here is registered by plugin.py; each receives the Scheduler as `self`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from branchwise import request_meta
from branchwise.config import BranchwiseConfig

logger = logging.getLogger("branchwise")


def _proctitle() -> str:
    try:
        import setproctitle

        return setproctitle.getproctitle()
    except ImportError:  # pragma: no cover - setproctitle ships with the sglang closure
        return ""


@dataclass(slots=True)
class BranchwiseState:
    """What Branchwise keeps per scheduler process."""

    config: BranchwiseConfig
    pid: int = field(default_factory=os.getpid)
    proctitle: str = field(default_factory=_proctitle)
    counters: dict[str, int] = field(default_factory=dict)

    def bump(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def report(self) -> dict[str, Any]:
        return {"config": self.config.as_dict(), "pid": self.pid, "proctitle": self.proctitle,
                "counters": dict(self.counters)}


def state_of(scheduler: Any) -> BranchwiseState | None:
    return getattr(scheduler, "_branchwise", None)


def after_init(result: None, self: Any, *args: Any, **kwargs: Any) -> None:
    cfg = BranchwiseConfig.from_server_args(self.server_args)
    self._branchwise = BranchwiseState(cfg, proctitle=_proctitle())
    logger.info("%s (pid %d, %s)", cfg.log_line(), os.getpid(), self._branchwise.proctitle)


def after_get_internal_state(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    st = state_of(self)
    if st is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["branchwise"] = st.report()
    return result


def after_create_generation_req(req: Any, self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """Attach the parsed custom_params.branchwise as `req.bw_meta`; malformed input ends with HTTP 400."""
    st = state_of(self)
    if st is None:
        return req
    st.bump("requests_created")
    try:
        req.bw_meta = request_meta.parse(getattr(req.sampling_params, "custom_params", None))
    except request_meta.MetaError as e:
        req.bw_meta = request_meta.SERIAL
        req.set_finish_with_abort(f"Branchwise: {e}")
        st.bump("bad_requests")
    return req


def around_update_running_batch(orig: Any, self: Any, batch: Any) -> Any:
    st = state_of(self)
    if st is not None:
        st.bump("decode_updates")
    return orig(self, batch)


def after_process_batch_result(result: Any, self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    st = state_of(self)
    if st is not None:
        st.bump("batch_results")
    return result
