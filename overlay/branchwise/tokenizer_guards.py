"""Guards in the HTTP server process (SGLang's TokenizerManager) for what SGLang 0.5.23 lets fail.

input_ids range: SGLang checks the length of a prompt given as `input_ids` but not its values; an id
outside [0, vocab) reaches the embedding lookup inside the scheduler, which dies (IndexError on
CPU, a device-side assert on GPU) and takes every other request with it. The per-request
validation rejects it instead, as SGLang's own checks do there: ValueError, HTTP 400.

stream abort task: a streamed /generate response carries a background task that aborts the rid
2 s after the stream ends, reading `obj.is_single`, which only the request's normalization sets.
When normalization refused the request before setting it (a streamed body with neither text nor
input_ids, or a check hooked in front of it) or never ran (the client left before the stream's
generator started), the task raises AttributeError after the response; uvicorn then closes the
keep-alive connection, which by then may carry the same client's next request, and that request is
lost. An unnormalized request never reached the scheduler, so there is nothing to abort: the task
is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def after_validate_one_request(result: Any, self: Any, obj: Any, input_ids: Any = None, *args: Any,
                               **kwargs: Any) -> Any:
    if input_ids:  # text prompts come from the tokenizer: in range, and min/max cost ~10 ns per id
        vocab = self.model_config.vocab_size
        lo, hi = min(input_ids), max(input_ids)
        if lo < 0 or hi >= vocab:
            raise ValueError(f"input_ids contains token id {lo if lo < 0 else hi}, outside the "
                             f"vocabulary [0, {vocab})")
    return result


def around_create_abort_task(orig: Callable[..., Any], self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    tasks = orig(self, obj, *args, **kwargs)
    for task in getattr(tasks, "tasks", ()):
        task.func = _unless_unnormalized(task.func, obj)
    return tasks


def _unless_unnormalized(fn: Callable[..., Any], obj: Any) -> Callable[..., Any]:
    async def run(*args: Any, **kwargs: Any) -> Any:
        if hasattr(obj, "is_single"):  # set by normalize_batch_and_arguments
            return await fn(*args, **kwargs)
        return None

    return run
