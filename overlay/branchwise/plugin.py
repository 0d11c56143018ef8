"""SGLang plugin entry point (`sglang.srt.plugins` group): the only place that names hook targets.

`load_plugins()` runs `register()` in every SGLang process (HTTP server, scheduler, detokenizer)
before the Scheduler is built. Registration must stay cheap and must not log: logging is not yet
configured here, so the scheduler logs Branchwise's settings from inside its __init__ hook.
"""

from __future__ import annotations

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from branchwise import scheduler_hook as sh

    hooks = [
        (f"{SCHEDULER}.__init__", sh.after_init, HookType.AFTER),
        (f"{SCHEDULER}.get_internal_state", sh.after_get_internal_state, HookType.AFTER),
        (f"{SCHEDULER}._create_generation_req", sh.after_create_generation_req, HookType.AFTER),
        (f"{SCHEDULER}.update_running_batch", sh.around_update_running_batch, HookType.AROUND),
        (f"{SCHEDULER}.process_batch_result", sh.after_process_batch_result, HookType.AFTER),
    ]
    for target, fn, kind in hooks:
        HookRegistry.register(target, fn, kind)
