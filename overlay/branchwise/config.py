"""Branchwise settings: CLI value parsers and one frozen settings object.

The parsers are what SGLang's argparse calls for Branchwise's flags (patched into ServerArgs), so a
bad value fails at argument parsing, before any model loads. No SGLang import here.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from typing import Any

from branchwise.request_meta import GRAMMARS
from branchwise.taper.policies import parse_policy_name
from branchwise.taper.utility import UTILITY_NAMES as UTILITIES


def parse_rho(value: str | float) -> float:
    rho = float(value)
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"--taper-rho must be in (0, 1], got {value!r}")
    return rho


def parse_positive_ms(value: str | float) -> float:
    ms = float(value)
    if not ms > 0.0:
        raise ValueError(f"a TPOT SLO must be > 0 ms, got {value!r}")
    return ms


def _argparse_type(fn):
    """Wrap a parser so argparse prints our message (it hides messages of plain ValueErrors)."""

    def wrapped(value):
        try:
            return fn(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    wrapped.__name__ = fn.__name__
    return wrapped


policy_arg = _argparse_type(parse_policy_name)
rho_arg = _argparse_type(parse_rho)
slo_arg = _argparse_type(parse_positive_ms)


@dataclass(frozen=True, slots=True)
class BranchwiseConfig:
    branch_policy: str = "off"
    branch_slo_tpot_ms: float = 50.0
    taper_rho: float = 0.8
    taper_utility: str = "linear"
    latency_model: str | None = None
    branch_grammar: str = "none"
    async_output: bool = False
    parallel_sampling: bool = False

    @classmethod
    def from_server_args(cls, server_args: Any) -> BranchwiseConfig:
        """Read the patched ServerArgs fields; an unpatched SGLang gives the defaults (policy off)."""
        defaults = cls()
        values = {f: getattr(server_args, f, getattr(defaults, f)) for f in cls.__slots__}
        env_policy = os.environ.get("BRANCHWISE_POLICY")  # for runs without `make apply`
        if env_policy and not hasattr(server_args, "branch_policy"):
            values["branch_policy"] = env_policy
        return cls(**values).validated()

    def validated(self) -> BranchwiseConfig:
        parse_policy_name(self.branch_policy)
        parse_rho(self.taper_rho)
        parse_positive_ms(self.branch_slo_tpot_ms)
        if self.taper_utility not in UTILITIES:
            raise ValueError(f"invalid --taper-utility {self.taper_utility!r}; valid: {', '.join(UTILITIES)}")
        if self.branch_grammar not in GRAMMARS:
            raise ValueError(f"invalid --branch-grammar {self.branch_grammar!r}; valid: {', '.join(GRAMMARS)}")
        return self

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def log_line(self) -> str:
        return "Branchwise active: " + " ".join(f"{k}={v}" for k, v in self.as_dict().items())
