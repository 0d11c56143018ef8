"""A prompt given as token ids must lie in the model's vocabulary (HTTP server process).

SGLang 0.5.23 checks the length of `input_ids` but not their values: an id outside [0, vocab)
reaches the embedding lookup inside the scheduler, which dies (IndexError on CPU, a device-side
assert on GPU) and takes every other request with it. The tokenizer manager's per-request
validation rejects it instead, as SGLang's own checks do there: ValueError, HTTP 400.
"""

from __future__ import annotations

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
