"""Reject malformed /generate requests in the HTTP server (docs/design/request-validation.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard

from branchwise import request_meta

if TYPE_CHECKING:
    from fastapi import BackgroundTasks
    from sglang.srt.managers.io_struct import EmbeddingReqInput, GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    ReqInput = GenerateReqInput | EmbeddingReqInput

logger = logging.getLogger("branchwise.ingress.validate")
MAX_MESSAGE = 300
MAX_N = 128  # parallel samples per request (OpenAI's limit for n)
# Past these bounds a float32 logit becomes inf and softmax NaN (why: request-validation.md).
MAX_LOGIT_BIAS = 1e30  # SGLang's own bound when it sanitizes NaN logits
MIN_REPETITION_PENALTY = 1e-6
# top_k and min_new_tokens become int32 tensors in the scheduler (SGLang's "all" top_k is 2**30)
MAX_TOP_K = 2**30
INT32_MAX = 2**31 - 1


def check_sampling_params(sampling_params: object) -> None:
    """ValueError (HTTP 400) for what SGLang would pass on unchecked in sampling_params (code-notes.md)."""
    for params in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        if not isinstance(params, dict):
            continue
        request_meta.parse(params.get("custom_params"))
        if "n" in params:
            check_n(params["n"])
        for key, hi in (("top_k", MAX_TOP_K), ("min_new_tokens", INT32_MAX)):
            value = params.get(key)
            if _is_num(value) and value > hi:
                raise ValueError(f"sampling_params.{key} must be at most {hi}, "
                                 f"got {request_meta.show(value)}")
        penalty = params.get("repetition_penalty")
        if _is_num(penalty) and 0 < penalty < MIN_REPETITION_PENALTY:
            raise ValueError("sampling_params.repetition_penalty must be at least "
                             f"{MIN_REPETITION_PENALTY:g}, got {request_meta.show(penalty)}")
        bias = params.get("logit_bias")
        if isinstance(bias, dict):
            for value in bias.values():
                if _is_num(value) and not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise ValueError(f"sampling_params.logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                     f"{MAX_LOGIT_BIAS:g}], got {request_meta.show(value)}")


def check_n(n: object) -> None:
    """The number of parallel samples: an integer in [1, MAX_N] (SGLang answers n < 1 with one)."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ValueError(f"sampling_params.n must be an integer in [1, {MAX_N}], got {request_meta.show(n)}")


def check_vocab_bounds(obj: ReqInput, vocab_size: object) -> None:
    """Values that index or size a vocab-wide tensor: stop token ids and top_logprobs_num."""
    if not isinstance(vocab_size, int):
        return
    params = getattr(obj, "sampling_params", None)
    ids = params.get("stop_token_ids") if isinstance(params, dict) else None
    for token in ids if isinstance(ids, list | tuple | set) else ():
        if _is_num(token) and not 0 <= token < vocab_size:
            raise ValueError(f"sampling_params.stop_token_ids must be token ids in [0, {vocab_size}), "
                             f"got {request_meta.show(token)}")
    top = getattr(obj, "top_logprobs_num", None)
    if _is_num(top) and not 0 <= top <= vocab_size:
        raise ValueError(f"top_logprobs_num must be in [0, {vocab_size}], got {request_meta.show(top)}")


def _is_num(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def as_bad_request(err: Exception, where: str) -> ValueError:
    """The ValueError SGLang turns into HTTP 400, for an exception raised by a client's input."""
    name = type(err).__name__
    # the traceback at DEBUG: a client sending such requests must not fill the log
    logger.debug("Branchwise: %s raised %s on a client request; answering HTTP 400", where, name,
                 exc_info=err)
    try:
        msg = str(err)
    except Exception:  # noqa: BLE001 - str() of an exception can itself fail (int digit limit)
        msg = ""
    msg = f"invalid request ({name}: {msg})"
    return ValueError(msg if len(msg) <= MAX_MESSAGE else msg[: MAX_MESSAGE - 3] + "...")


def around_normalize_batch_and_arguments(orig: Callable[..., None], obj: ReqInput,
                                         *args: Any, **kwargs: Any) -> None:
    try:
        check_sampling_params(getattr(obj, "sampling_params", None))
        out = orig(obj, *args, **kwargs)
        check_rids(obj)
        return out
    except ValueError:
        _nothing_dispatched(obj)
        raise
    except Exception as err:  # noqa: BLE001 - only the client's request is being read here
        _nothing_dispatched(obj)
        raise as_bad_request(err, "GenerateReqInput.normalize_batch_and_arguments") from err


def check_rids(obj: ReqInput) -> None:
    """After normalization: one string rid per request (a list rid for one request was HTTP 500)."""
    rid = getattr(obj, "rid", None)
    if getattr(obj, "is_single", True):
        ok = isinstance(rid, str)
    else:
        ok = isinstance(rid, list) and all(isinstance(one, str) for one in rid)
    if not ok:
        raise ValueError("rid must be a string (a list of strings for a batch), got "
                         + request_meta.show(rid))


def _nothing_dispatched(obj: ReqInput) -> None:
    """A refused request still meets SGLang's disconnect-abort task: give it `is_single` and no rids."""
    obj.is_single, obj.rid = False, []


def check_prompt_not_empty(input_ids: object, input_embeds: object, mm_inputs: object) -> None:
    """A text prompt that tokenizes to nothing (no BOS) would be a zero-length prefill: refuse it."""
    if isinstance(input_ids, list | tuple) and not input_ids and input_embeds is None and mm_inputs is None:
        raise ValueError("the prompt is empty: text tokenizes to no tokens")


def around_create_tokenized_object(orig: Callable[..., Any], manager: TokenizerManager, obj: ReqInput,
                                   *args: Any, **kwargs: Any) -> Any:
    check_vocab_bounds(obj, getattr(getattr(manager, "model_config", None), "vocab_size", None))
    # SGLang's signature: (obj, input_text, input_ids, input_embeds=None, mm_inputs=None, ...)
    given = dict(zip(("input_text", "input_ids", "input_embeds", "mm_inputs"), args, strict=False)) | kwargs
    check_prompt_not_empty(given.get("input_ids"), given.get("input_embeds"), given.get("mm_inputs"))
    try:
        return orig(manager, obj, *args, **kwargs)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - only the client's request is being read here
        raise as_bad_request(err, "TokenizerManager._create_tokenized_object") from err


def after_validate_one_request(result: None, manager: TokenizerManager, obj: ReqInput,
                               input_ids: list[int] | None = None, *args: Any, **kwargs: Any) -> None:
    if input_ids:  # text prompts come from the tokenizer: in range
        vocab = manager.model_config.vocab_size
        lo, hi = min(input_ids), max(input_ids)
        if lo < 0 or hi >= vocab:
            raise ValueError(f"input_ids contains token id {lo if lo < 0 else hi}, outside the "
                             f"vocabulary [0, {vocab})")
    return result


def around_create_abort_task(orig: Callable[..., BackgroundTasks], manager: TokenizerManager,
                             obj: GenerateReqInput, *args: Any, **kwargs: Any) -> BackgroundTasks:
    tasks = orig(manager, obj, *args, **kwargs)
    for task in getattr(tasks, "tasks", ()):
        task.func = _unless_unnormalized(task.func, obj)
    return tasks


def _unless_unnormalized(fn: Callable[..., Any], obj: GenerateReqInput) -> Callable[..., Any]:
    async def run(*args: Any, **kwargs: Any) -> Any:
        if hasattr(obj, "is_single"):  # set by normalize_batch_and_arguments
            return await fn(*args, **kwargs)
        return None

    return run
