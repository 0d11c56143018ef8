"""--emulate-device: SGLang's forwards complete at a modeled GPU's time (the model: device_model.py).

Outputs are the real model's; only when results are seen changes. Docs: docs/design/emulated-device.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from branchwise.device_model import Composition, DeviceEvent, DeviceStream, Forward, parse_spec
from branchwise.device_time import EMULATED

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    from branchwise.config import BranchwiseConfig

Hook = Callable[..., Any]
logger = logging.getLogger("branchwise")


def composition(batch: ScheduleBatch) -> tuple[Composition, str] | None:
    """The forward `batch` launches, by kind (decode / extend / mixed); None where it runs no forward."""
    mode = batch.forward_mode
    if mode.is_decode():
        rows = batch.batch_size()
        lens = batch.seq_lens_cpu
        if lens is not None:
            ctx = int(lens[:rows].sum())
        else:
            ctx = sum(len(r.origin_input_ids) + len(r.output_ids) for r in batch.reqs)
        return Composition(decode_rows=rows, context_tokens=ctx), "decode"
    if not mode.is_extend():
        return None
    prefix, extend = batch.prefix_lens or [], batch.extend_lens or []
    tail = _running_rows(batch) if mode.is_mixed() else 0  # mix_with_running appends the decode rows
    split = len(extend) - tail
    comp = Composition(decode_rows=tail, context_tokens=sum(p + e for p, e in zip(prefix[split:], extend[split:],
                                                                                  strict=True)),
                       prefill_rows=split, prefill_tokens=sum(extend[:split]))
    return comp, "mixed" if mode.is_mixed() else "extend"


def _running_rows(batch: ScheduleBatch) -> int:
    for name in ("mix_running_indices_cpu", "mix_running_indices"):
        value = getattr(batch, name, None)
        if value is not None:
            return len(value)
    return 0


def unsupported(scheduler: Scheduler, config: BranchwiseConfig) -> str | None:
    """Why --emulate-device cannot run on this server, or None."""
    args = scheduler.server_args
    checks = [
        (config.async_output and os.environ.get("BRANCHWISE_FORWARD_THREAD", "").strip() == "1",
         "the Albireo CPU forward thread (env BRANCHWISE_FORWARD_THREAD=1): unset it"),
        (getattr(args, "speculative_algorithm", None) is not None,
         "speculative decoding (its verify forwards are not modeled): drop --speculative-algorithm"),
        (getattr(args, "pp_size", 1) > 1, "pipeline parallelism: use --pp-size 1"),
        (getattr(args, "disaggregation_mode", "null") not in (None, "null"),
         "PD disaggregation: drop --disaggregation-mode"),
    ]
    return next((why for bad, why in checks if bad), None)


def build(scheduler: Scheduler, config: BranchwiseConfig) -> DeviceStream | None:
    """The scheduler's emulated device (None without the flag); raises on a mode it does not model."""
    if not config.emulate_device:
        return None
    why = unsupported(scheduler, config)
    if why is not None:
        raise ValueError(f"--emulate-device does not run with {why}")
    skip = getattr(scheduler.server_args, "skip_server_warmup", False)
    stream = DeviceStream(parse_spec(config.emulate_device), warmup_rids=None if skip else frozenset())
    preset = stream.preset
    logger.info("Branchwise emulated device %s: floor %.3f ms, %.4f ms/row, %.4f us/context token, "
                "%.3f us/prefill token, %d graph sizes, time scale %g", preset.name, 1e3 * preset.floor_s,
                1e3 * preset.row_s, 1e6 * preset.context_token_s, 1e6 * preset.prefill_token_s,
                len(preset.graph_batch_sizes), preset.time_scale)
    return stream


# ---------------------------------------------------------------- hook body (target in plugin.py)
def around_run_batch(orig: Hook, scheduler: Scheduler, batch: ScheduleBatch, *args: Any,
                     **kwargs: Any) -> Any:
    bw = getattr(scheduler, "branchwise", None)
    stream = bw.device if bw is not None else None
    found = composition(batch) if stream is not None else None
    if found is None:
        return orig(scheduler, batch, *args, **kwargs)
    comp, kind = found
    warmup = stream.in_warmup(req.rid for req in batch.reqs)
    fwd = stream.launch(comp, stream.clock(), kind, running=_requests_running(scheduler, kind), warmup=warmup)
    result = orig(scheduler, batch, *args, **kwargs)
    if kind == "decode":
        _book_step(bw, batch, fwd)
    if not hasattr(result, "copy_done"):  # not a forward result SGLang waits on: wait here
        stream.computed(fwd)
        stream.wait(fwd)
        return result
    sample = getattr(result, "delay_sample_func", None)
    if sample is not None:  # grammar: the computation ends with the sampling SGLang launches later
        result.delay_sample_func = _sampled_then_done(stream, fwd, sample)
    else:
        stream.computed(fwd)
    result.copy_done = DeviceEvent(stream, fwd, result.copy_done)
    return result


def _requests_running(scheduler: Scheduler, kind: str) -> bool:
    """Whether rows were running when this forward was prepared (an idle prefill waited on arrival)."""
    if kind != "extend":
        return True
    running = getattr(scheduler, "running_batch", None)
    return running is not None and not running.is_empty()


def _book_step(bw: Any, batch: ScheduleBatch, fwd: Forward) -> None:
    """A decode step's modeled time by forward_iter, for TAPER's refit (device_time.py)."""
    state = bw.state
    book = state.device_times if state is not None else None
    if book is not None and book.source == EMULATED:
        book.put(batch.forward_iter, fwd.modeled_s)


def _sampled_then_done(stream: DeviceStream, fwd: Forward, sample: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        out = sample()
        stream.computed(fwd)
        return out

    return run
