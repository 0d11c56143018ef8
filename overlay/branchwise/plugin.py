"""SGLang plugin entry point (`sglang.srt.plugins` group): the only place that names hook targets.

`load_plugins()` runs `register()` in every SGLang process (HTTP server, scheduler, detokenizer)
before the Scheduler is built. Registration must stay cheap and must not log: logging is not yet
configured here, so the scheduler logs Branchwise's settings from inside its __init__ hook. On any
SGLang version other than the one the hook targets and patches are written for, register() installs
nothing and writes one line to stderr (`_note_once`).
"""

from __future__ import annotations

import os
import sys

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
REQ = "sglang.srt.managers.schedule_batch.Req"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
RESULT_PROCESSOR = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
SAMPLING_INFO = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo"
TP_WORKER = "sglang.srt.managers.tp_worker.TpModelWorker"
OVERLAP_UTILS = "sglang.srt.managers.overlap_utils"
LOGITS_PROCESSOR = "sglang.srt.layers.logits_processor.LogitsProcessor"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
RADIX_CACHE = "sglang.srt.mem_cache.radix_cache.RadixCache"
UNIFIED_RADIX_CACHE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
IO_STRUCT = "sglang.srt.managers.io_struct"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller.DataParallelController"


def _flag_declared(name: str) -> bool:
    """A Branchwise flag can only be on where the ServerArgs patch declares it (`make apply`)."""
    from sglang.srt.arg_groups.fields.schedule import Schedule

    return name in Schedule.__struct_fields__


def _async_output_hooks(HookType):
    """Albireo async output (--async-output): result processing off the critical path."""
    from branchwise.albireo import async_output as ao

    return [
        (f"{RESULT_PROCESSOR}.process_batch_result_decode", ao.around_process_batch_result_decode,
         HookType.AROUND),
        (f"{REQ}.check_match_stop_str_prefix", ao.around_check_match_stop_str_prefix, HookType.AROUND),
        (f"{SCHEDULER}.set_internal_state", ao.around_set_internal_state, HookType.AROUND),
    ]


def _forward_thread_hooks(HookType):
    """Albireo forward thread (CPU, under --async-output): the overlap loop's forward-stream work on
    a FIFO worker thread."""
    from branchwise.albireo import forward_thread as ft

    return [
        (f"{SCHEDULER}.run_batch", ft.around_run_batch, HookType.AROUND),
        (f"{OVERLAP_UTILS}.resolve_forward_inputs", ft.around_resolve_forward_inputs, HookType.AROUND),
        (f"{TP_WORKER}.forward_batch_generation", ft.around_forward_batch_generation, HookType.AROUND),
        (f"{SCHEDULER}._relay_forward_payload", ft.around_relay_forward_payload, HookType.AROUND),
        (f"{SCHEDULER}._copy_result_to_cpu", ft.around_copy_result_to_cpu, HookType.AROUND),
        (f"{RADIX_CACHE}.checkpoint", ft.around_checkpoint, HookType.AROUND),
        (f"{UNIFIED_RADIX_CACHE}.checkpoint", ft.around_checkpoint, HookType.AROUND),
        (f"{SAMPLING_INFO}.update_regex_vocab_mask", ft.around_update_regex_vocab_mask, HookType.AROUND),
    ]


def _sampler_hooks(HookType):
    """Albireo sequence-parallel sampling (--parallel-sampling)."""
    from branchwise.albireo import sp_sampler_hook as sp

    return [
        (f"{SAMPLING_INFO}.from_schedule_batch", sp.after_from_schedule_batch, HookType.AFTER),
        (f"{MODEL_RUNNER}.sample", sp.around_sample, HookType.AROUND),
        (f"{MODEL_RUNNER}.forward", sp.around_forward, HookType.AROUND),
        (f"{LOGITS_PROCESSOR}._get_logits", sp.around_get_logits, HookType.AROUND),
    ]


def _albireo_hooks(HookType):
    """Albireo's features, where the ServerArgs patch declares their flags; each hook body passes
    through unless its component is on for this server."""
    hooks = []
    if _flag_declared("async_output"):
        hooks += _async_output_hooks(HookType) + _forward_thread_hooks(HookType)
    if _flag_declared("parallel_sampling"):
        hooks += _sampler_hooks(HookType)
    return hooks


def _step_timer_hooks(HookType):
    """Bench-only instrument (env BRANCHWISE_STEP_TIMER); never registered in normal serving."""
    from branchwise import step_timer as t

    return [
        (f"{SCHEDULER}.ingest_requests", t.around_ingest, HookType.AROUND),
        (f"{SCHEDULER}.get_next_batch_to_run", t.around_get_next_batch, HookType.AROUND),
        (f"{SCHEDULER}.run_batch", t.around_run_batch, HookType.AROUND),
        (f"{SCHEDULER}.process_batch_result", t.around_process_batch_result, HookType.AROUND),
        (f"{MODEL_RUNNER}.forward", t.around_forward, HookType.AROUND),
        (f"{MODEL_RUNNER}.sample", t.around_sample, HookType.AROUND),
        (f"{STREAMER}.stream_output", t.around_stream_output, HookType.AROUND),
    ]


def _fork_hooks(HookType):
    """Server-side fork/join (fork.py); its request-creation step runs inside runtime's hook."""
    from branchwise import fork

    return [
        (f"{SCHEDULER}.ingest_requests", fork.after_ingest_requests, HookType.AFTER),
        (f"{SCHEDULER}.abort_request", fork.after_abort_request, HookType.AFTER),
        (f"{SCHEDULER}.send_abort_output", fork.around_send_abort_output, HookType.AROUND),
        (f"{SCHEDULER}.is_fully_idle", fork.after_is_fully_idle, HookType.AFTER),
        (f"{STREAMER}.stream_output", fork.around_stream_output, HookType.AROUND),
    ]


def _dp_hooks(HookType):
    """Phase-affine DP dispatch (dp_dispatch.py), in the DP controller process; each scheduler's
    part is built and reported by runtime.py."""
    from branchwise import dp_dispatch as dp

    return [
        (f"{DP_CONTROLLER}.__init__", dp.after_controller_init, HookType.AFTER),
        (f"{DP_CONTROLLER}.dispatching_with_trace", dp.around_dispatching_with_trace, HookType.AROUND),
    ]


def _runtime_hooks(HookType, timer_mode: str | None):
    """The composition root (runtime.py): the only Scheduler.__init__ and get_internal_state hooks,
    and request creation, whose steps (taper, fork, dp) it runs in a fixed order."""
    from branchwise import runtime

    hooks = [(f"{SCHEDULER}.__init__", runtime.after_scheduler_init, HookType.AFTER)]
    if timer_mode != "stock":
        hooks.append((f"{SCHEDULER}.get_internal_state", runtime.after_get_internal_state, HookType.AFTER))
    if timer_mode not in ("stock", "albireo"):
        hooks.append((f"{SCHEDULER}._create_generation_req", runtime.after_create_generation_req, HookType.AFTER))
    return hooks


def _taper_hooks(HookType):
    """Per-step branch admission (scheduler_hook.py) and the deferred rows' penalties (deferral.py)."""
    from branchwise import deferral
    from branchwise import scheduler_hook as sh

    return [
        (f"{SCHEDULER}.update_running_batch", sh.around_update_running_batch, HookType.AROUND),
        (f"{SCHEDULER}.process_batch_result", sh.after_process_batch_result, HookType.AFTER),
        # runs only for batches with penalties: which token deferred rows cumulate (deferral.py)
        (f"{SCHEDULE_BATCH}.cumulate_penalty_output_tokens", deferral.around_cumulate_penalty_output_tokens,
         HookType.AROUND),
    ]


def _validate_hooks(HookType):
    """Malformed requests end as HTTP 400 in the HTTP server process (validate.py)."""
    from branchwise import validate as v

    return [
        (f"{IO_STRUCT}.GenerateReqInput.normalize_batch_and_arguments", v.around_normalize_batch_and_arguments,
         HookType.AROUND),
        (f"{TOKENIZER_MANAGER}._create_tokenized_object", v.around_create_tokenized_object, HookType.AROUND),
        (f"{TOKENIZER_MANAGER}._validate_one_request", v.after_validate_one_request, HookType.AFTER),
        (f"{TOKENIZER_MANAGER}.create_abort_task", v.around_create_abort_task, HookType.AROUND),
    ]


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
            "no Branchwise hooks installed (branch policy off: SGLang serves unchanged)")


def _note_once(line: str) -> None:
    """One line on stderr per server: logging is not configured yet in any SGLang process when
    plugins load, so a log record here would be dropped. The process that loads plugins first (the
    launcher, before it spawns the scheduler and detokenizer) writes it; the env var keeps its
    children quiet."""
    if os.environ.get(VERSION_NOTED_ENV) != "1":
        os.environ[VERSION_NOTED_ENV] = "1"
        print(f"WARNING {line}", file=sys.stderr, flush=True)


def register() -> None:
    if (why := _version_mismatch()) is not None:
        _note_once(why)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from branchwise import step_timer

    # bench modes: "stock" = SGLang + the timer only; "albireo" = + Albireo's hooks, no other Branchwise hook
    timer_mode = step_timer.enabled()
    hooks = _runtime_hooks(HookType, timer_mode)
    if timer_mode not in ("stock", "albireo"):
        hooks += _taper_hooks(HookType) + _fork_hooks(HookType) + _dp_hooks(HookType) + _validate_hooks(HookType)
    if timer_mode != "stock":
        hooks += _albireo_hooks(HookType)
    if timer_mode:
        hooks += _step_timer_hooks(HookType)
    for target, fn, kind in hooks:
        HookRegistry.register(target, fn, kind)
