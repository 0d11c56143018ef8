"""Host values onto the device without stalling the scheduler: the one way the overlay's per-step
code builds a device tensor from host data (tests/unit/test_hostcopy.py holds every module to it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """`values` as a 1-D tensor of `dtype` on `device`, queued like SGLang's own host-to-device copies."""
    if torch.device(device).type == "cpu":
        return torch.tensor(values, dtype=dtype)
    from sglang.srt.utils.common import async_h2d  # pins where the platform can (not under CC)

    return async_h2d(list(values), dtype=dtype, device=device)
