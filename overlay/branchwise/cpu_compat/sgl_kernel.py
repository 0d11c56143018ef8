"""CPU-only stand-in for the CUDA package `sgl_kernel` (never installed on a GPU machine)."""

from __future__ import annotations

from typing import Any

__version__ = "0.0.0+branchwise.cpu"
IS_BRANCHWISE_CPU_STUB = True


class _Stub:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{self._name} is not available: this is Branchwise's CPU-only stand-in "
            "(overlay/branchwise/cpu_compat); install the real sgl-kernel on a GPU machine."
        )

    def __getattr__(self, name: str) -> _Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self._name}.{name}")

    def __repr__(self) -> str:
        return f"<branchwise cpu stub sgl_kernel.{self._name}>"


def __getattr__(name: str) -> Any:  # PEP 562: any imported name becomes a stub
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub(name)
