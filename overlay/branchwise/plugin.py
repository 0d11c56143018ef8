"""SGLang plugin entry point (`sglang.srt.plugins` group) and the table of every HookRegistry target."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.plugins.hook_registry import HookType as HookKind

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
REQ = "sglang.srt.managers.schedule_batch.Req"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
RESULT_PROCESSOR = ("sglang.srt.managers.scheduler_components.batch_result_processor."
                    "SchedulerBatchResultProcessor")
SAMPLING_INFO = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo"
TP_WORKER = "sglang.srt.managers.tp_worker.TpModelWorker"
OVERLAP_UTILS = "sglang.srt.managers.overlap_utils"
LOGITS_PROCESSOR = "sglang.srt.layers.logits_processor.LogitsProcessor"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
RADIX_CACHE = "sglang.srt.mem_cache.radix_cache.RadixCache"
UNIFIED_RADIX_CACHE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
GENERATE_REQ_INPUT = "sglang.srt.managers.io_struct.GenerateReqInput"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller.DataParallelController"
TIME_STATS = "sglang.srt.observability.req_time_stats.SchedulerReqTimeStats"


def _flag_declared(name: str) -> bool:
    """A Branchwise flag can only be on where the ServerArgs patch declares it (`make apply`)."""
    from sglang.srt.arg_groups.fields.schedule import Schedule

    return name in Schedule.__struct_fields__


def hook_table(HookType: type[HookKind],
               timer_mode: str | None) -> list[tuple[str, Callable[..., Any], HookKind]]:
    """Every hook Branchwise installs, one row each, grouped by component (columns: code-notes.md)."""
    from branchwise import deferral, runtime
    from branchwise import device_time as dt
    from branchwise import emulated_device as ed
    from branchwise import metrics as m
    from branchwise import prefill_hook as pf
    from branchwise import scheduler_hook as sh
    from branchwise import step_timer as t
    from branchwise.albireo import async_output as ao
    from branchwise.albireo import forward_thread as ft
    from branchwise.albireo import sp_sampler_hook as sp
    from branchwise.fork import hooks as fork
    from branchwise.ingress import dp_dispatch as dp
    from branchwise.ingress import n_sampling as ns
    from branchwise.ingress import validate as v

    serving = timer_mode not in ("stock", "albireo")
    albireo = timer_mode != "stock"
    timer = timer_mode is not None
    async_out = albireo and _flag_declared("async_output")  # the forward thread runs under it too
    sampling = albireo and _flag_declared("parallel_sampling")
    emulate = _flag_declared("emulate_device")  # in every mode: the step timer's measure on it too
    table = [
        # runtime.py: builds and reports scheduler.branchwise; request creation runs taper, fork, dp in order
        (True, f"{SCHEDULER}.__init__", runtime.after_scheduler_init),
        (albireo or emulate, f"{SCHEDULER}.get_internal_state", runtime.after_get_internal_state),
        (serving, f"{SCHEDULER}._create_generation_req", runtime.after_create_generation_req),
        # metrics.py (--enable-metrics): branch requests, phases and each one's TPOT SLO verdict, every policy
        (serving, f"{SCHEDULER}._add_request_to_queue", runtime.after_add_request_to_queue),
        (serving, f"{TIME_STATS}.set_prefill_finished_time", m.after_set_prefill_finished_time),
        (serving, f"{TIME_STATS}.set_completion_time", m.after_set_completion_time),
        # taper (scheduler_hook.py); deferral.py: which token a deferred row's penalties cumulate
        (serving, f"{SCHEDULER}.update_running_batch", sh.around_update_running_batch),
        (serving, f"{SCHEDULER}.process_batch_result", runtime.after_process_batch_result),
        # prefill_hook.py (BRANCHWISE_PREFILL_BUDGET=1, taper): each prefill's chunk from the slack rule
        (serving, f"{SCHEDULER}._get_new_batch_prefill_raw", pf.around_get_new_batch_prefill_raw),
        (serving, f"{SCHEDULE_BATCH}.cumulate_penalty_output_tokens",
         deferral.around_cumulate_penalty_output_tokens),
        # fork/hooks.py: server-side fork/join (its per-token hook sits on each tracked Req instance)
        (serving, f"{SCHEDULER}.ingest_requests", fork.after_ingest_requests),
        (serving, f"{SCHEDULER}.abort_request", fork.after_abort_request),
        (serving, f"{SCHEDULER}.send_abort_output", fork.around_send_abort_output),
        (serving, f"{SCHEDULER}.is_fully_idle", fork.after_is_fully_idle),
        (serving, f"{STREAMER}.stream_output", fork.around_stream_output),
        # ingress/dp_dispatch.py: phase-affine placement, in the DP controller process
        (serving, f"{DP_CONTROLLER}.__init__", dp.after_controller_init),
        (serving, f"{DP_CONTROLLER}.dispatching_with_trace", dp.around_dispatching_with_trace),
        # ingress/n_sampling.py: SGLang's own n > 1 samples stamped as one phase, in the HTTP server process
        (serving, f"{TOKENIZER_MANAGER}._handle_batch_request", ns.around_handle_batch_request),
        (serving, f"{GENERATE_REQ_INPUT}.regenerate_rid", ns.around_regenerate_rid),
        (serving, f"{TOKENIZER_MANAGER}._send_one_request", ns.around_send_one_request),
        (serving, f"{TOKENIZER_MANAGER}.abort_request", ns.around_abort_request),
        # ingress/validate.py: malformed requests end as HTTP 400 in the HTTP server process
        (serving, f"{GENERATE_REQ_INPUT}.normalize_batch_and_arguments",
         v.around_normalize_batch_and_arguments),
        (serving, f"{TOKENIZER_MANAGER}._create_tokenized_object", v.around_create_tokenized_object),
        (serving, f"{TOKENIZER_MANAGER}._validate_one_request", v.after_validate_one_request),
        (serving, f"{TOKENIZER_MANAGER}.create_abort_task", v.around_create_abort_task),
        # albireo/async_output.py (--async-output): result processing off the critical path
        (async_out, f"{RESULT_PROCESSOR}.process_batch_result_decode", ao.around_process_batch_result_decode),
        (async_out, f"{REQ}.check_match_stop_str_prefix", ao.around_check_match_stop_str_prefix),
        (async_out, f"{SCHEDULER}.set_internal_state", ao.around_set_internal_state),
        # albireo/forward_thread.py (CPU, under --async-output): forward-stream work on a worker thread
        (async_out, f"{SCHEDULER}.run_batch", ft.around_run_batch),
        (async_out, f"{OVERLAP_UTILS}.resolve_forward_inputs", ft.around_resolve_forward_inputs),
        (async_out, f"{TP_WORKER}.forward_batch_generation", ft.around_forward_batch_generation),
        (async_out, f"{SCHEDULER}._relay_forward_payload", ft.around_relay_forward_payload),
        (async_out, f"{SCHEDULER}._copy_result_to_cpu", ft.around_copy_result_to_cpu),
        (async_out, f"{RADIX_CACHE}.checkpoint", ft.around_checkpoint),
        (async_out, f"{UNIFIED_RADIX_CACHE}.checkpoint", ft.around_checkpoint),
        (async_out, f"{SAMPLING_INFO}.update_regex_vocab_mask", ft.around_update_regex_vocab_mask),
        # emulated_device.py (--emulate-device): a forward's result is seen at its modeled device time
        (emulate, f"{SCHEDULER}.run_batch", ed.around_run_batch),
        # device_time.py (a CUDA device): each decode step's device time, events on its forward stream
        (serving, f"{SCHEDULER}.run_batch", dt.around_run_batch),
        # albireo/sp_sampler_hook.py (--parallel-sampling): sequence-parallel sampling
        (sampling, f"{SAMPLING_INFO}.from_schedule_batch", sp.after_from_schedule_batch),
        (sampling, f"{MODEL_RUNNER}.sample", sp.around_sample),
        (sampling, f"{MODEL_RUNNER}.forward", sp.around_forward),
        (sampling, f"{LOGITS_PROCESSOR}._get_logits", sp.around_get_logits),
        # step_timer.py: the bench's per-iteration time split; never on in normal serving
        (timer, f"{SCHEDULER}.ingest_requests", t.around_ingest),
        (timer, f"{SCHEDULER}.get_next_batch_to_run", t.around_get_next_batch),
        (timer, f"{SCHEDULER}.run_batch", t.around_run_batch),
        (timer, f"{SCHEDULER}.process_batch_result", t.around_process_batch_result),
        (timer, f"{MODEL_RUNNER}.forward", t.around_forward),
        (timer, f"{MODEL_RUNNER}.sample", t.around_sample),
        (timer, f"{STREAMER}.stream_output", t.around_stream_output),
    ]
    return [(target, fn, _kind(HookType, fn)) for on, target, fn in table if on]


def _kind(HookType: type[HookKind], fn: Callable[..., Any]) -> HookKind:
    """A hook body's name says its kind: `after_*` runs after the target, `around_*` wraps it."""
    kind = fn.__name__.split("_", 1)[0]
    if kind not in ("after", "around"):
        raise ValueError(f"hook body {fn.__qualname__} must be named after_* or around_*")
    return HookType.AFTER if kind == "after" else HookType.AROUND


VERSION_NOTED_ENV = "BRANCHWISE_VERSION_NOTED"  # set once the mismatch line is written (children inherit it)


def _installed_sglang() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def _version_mismatch() -> str | None:
    """Why Branchwise must not hook this SGLang (its targets and patches are for one version), or None."""
    from branchwise.patcher import SGLANG_VERSION

    got = _installed_sglang()
    if got == SGLANG_VERSION:
        return None
    return (f"Branchwise: installed sglang is {got}, Branchwise supports sglang=={SGLANG_VERSION} only; "
            "no Branchwise hooks installed: SGLang serves unchanged")


def _note_once(line: str) -> None:
    """One line on stderr per server (logging is not configured yet); the env var quiets children."""
    if os.environ.get(VERSION_NOTED_ENV) != "1":
        os.environ[VERSION_NOTED_ENV] = "1"
        print(f"WARNING {line}", file=sys.stderr, flush=True)


def _register_support_check() -> None:
    """Refused modes fail the launch at argument resolution (support.py); registered once per process."""
    from sglang.srt.arg_groups import resolution_hooks

    from branchwise import support

    step, check = support.LAST_RESOLUTION_STEP, support.around_last_resolution_step
    if check not in getattr(resolution_hooks, "_HOOKS", {}).get(step, ()):
        resolution_hooks.register_resolution_hook(step)(check)


def register() -> None:
    if (why := _version_mismatch()) is not None:
        _note_once(why)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from branchwise import step_timer

    _register_support_check()
    for target, fn, kind in hook_table(HookType, step_timer.enabled()):
        HookRegistry.register(target, fn, kind)
