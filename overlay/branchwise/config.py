"""Branchwise settings: CLI value parsers (a bad value fails at argparse) and one frozen settings object."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from branchwise.device_model import DeviceSpecError, parse_spec
from branchwise.request_meta import GRAMMARS
from branchwise.taper.policies import parse_policy_name
from branchwise.taper.predictor import load_model
from branchwise.taper.utility import UTILITY_NAMES as UTILITIES

if TYPE_CHECKING:  # a type only: the module imports no SGLang
    from sglang.srt.server_args import ServerArgs

GRAMMAR_CLIENTS = ("allow", "deny")
PLUGIN_NAME = "branchwise"  # the sglang.srt.plugins entry point (pyproject.toml)
# The default policy: SGLang's own schedule (no step controller), branch requests still counted.
STOCK = "stock"
# Weights scale the "priority" utility's gains: unbounded, one request could take every admitted row.
MAX_WEIGHT = 10.0
# The prefill budget (taper only) is opted into by environment: a server flag would need a patch change
PREFILL_ENV, PREFILL_TTFT_ENV = "BRANCHWISE_PREFILL_BUDGET", "BRANCHWISE_PREFILL_TTFT_S"
_ON, _OFF = ("1", "on", "true", "yes"), ("", "0", "off", "false", "no")


def parse_rho(value: str | float) -> float:
    rho = float(value)
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"--taper-rho must be in (0, 1], got {value!r}")
    return rho


def parse_positive_ms(value: str | float) -> float:
    slo_ms = float(value)
    if not (slo_ms > 0.0 and math.isfinite(slo_ms)):
        raise ValueError(f"a TPOT SLO must be a finite number > 0 ms, got {value!r}")
    return slo_ms


def _positive_int(value: str | int, flag: str) -> int:
    try:
        count = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{flag} must be an integer >= 1, got {value!r}") from None
    if count < 1:
        raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
    return count


def parse_max_fanout(value: str | int) -> int:
    return _positive_int(value, "--branch-max-fanout")


def parse_max_branch_tokens(value: str | int | None) -> int | None:
    """A positive token count, or None for 'auto' (the server's KV pool size)."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    return _positive_int(value, "--branch-max-branch-tokens")


def parse_grammar_clients(value: str) -> str:
    mode = str(value).strip().lower()
    if mode not in GRAMMAR_CLIENTS:
        raise ValueError(f"invalid --branch-grammar-clients {value!r}; valid: {', '.join(GRAMMAR_CLIENTS)}")
    return mode


def parse_latency_model(path: str) -> str:
    """The --latency-model path, after reading and validating the file (load_model's checks)."""
    load_model(path)
    return path


def parse_emulate_device(spec: str) -> str:
    """The --emulate-device value (preset name or file, optionally @xS), after checking the preset."""
    try:
        parse_spec(spec)
    except DeviceSpecError as err:
        raise ValueError(str(err)) from None
    return str(spec).strip()


def parse_ttft_s(value: str | float) -> float:
    try:
        ttft = float(value)
    except ValueError:
        ttft = math.nan
    if not (ttft > 0.0 and math.isfinite(ttft)):
        raise ValueError(f"{PREFILL_TTFT_ENV} must be a finite number of seconds > 0, got {value!r}")
    return ttft


def prefill_settings(env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """BranchwiseConfig's prefill fields from PREFILL_ENV (on/off) and PREFILL_TTFT_ENV (seconds)."""
    on = env.get(PREFILL_ENV, "").strip().lower()
    if on not in _ON + _OFF:
        raise ValueError(f"{PREFILL_ENV} must be 1 (on) or 0 (off), got {on!r}")
    ttft = env.get(PREFILL_TTFT_ENV, "").strip()
    return {"prefill_budget": on in _ON, "prefill_ttft_s": parse_ttft_s(ttft) if ttft else None}


def _argparse_type(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap a parser so argparse prints our message (it hides messages of plain ValueErrors)."""

    def wrapped(value: Any) -> Any:
        try:
            return fn(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    wrapped.__name__ = fn.__name__
    return wrapped


def plugin_switched_off(env: Mapping[str, str] = os.environ) -> bool:
    """Whether SGLang skips the Branchwise plugin: SGLANG_PLUGINS set without it (empty loads all)."""
    allowed = {name.strip() for name in env.get("SGLANG_PLUGINS", "").split(",") if name.strip()}
    return bool(allowed) and PLUGIN_NAME not in allowed


def parse_policy_flag(value: str) -> str:
    """--branch-policy: a valid name; no step controller asked of a server whose plugin is off."""
    name = parse_policy_name(value)
    if name != STOCK and plugin_switched_off():
        raise ValueError(f"--branch-policy {name} needs the Branchwise plugin, which SGLANG_PLUGINS="
                         f"{os.environ['SGLANG_PLUGINS']!r} leaves out: add {PLUGIN_NAME} to SGLANG_PLUGINS, "
                         "or use --branch-policy stock")
    return name


policy_arg = _argparse_type(parse_policy_flag)
rho_arg = _argparse_type(parse_rho)
slo_arg = _argparse_type(parse_positive_ms)
fanout_arg = _argparse_type(parse_max_fanout)
branch_tokens_arg = _argparse_type(parse_max_branch_tokens)
latency_model_arg = _argparse_type(parse_latency_model)
emulate_device_arg = _argparse_type(parse_emulate_device)


@dataclass(frozen=True, slots=True)
class BranchwiseConfig:
    branch_policy: str = STOCK
    branch_slo_tpot_ms: float = 50.0
    branch_min_slo_tpot_ms: float | None = None  # None: half of branch_slo_tpot_ms
    taper_rho: float = 0.8
    taper_utility: str = "linear"
    latency_model: str | None = None
    branch_grammar: str = "none"
    branch_grammar_clients: str = "allow"
    branch_max_fanout: int = 16
    branch_max_branch_tokens: int | None = None  # None: the KV pool size (ForkManager resolves it)
    async_output: bool = False
    parallel_sampling: bool = False
    emulate_device: str | None = None  # a device preset spec (device_model.py); None: the real device
    prefill_budget: bool = False  # PREFILL_ENV: each prefill chunk sized by TAPER's slack (prefill_hook.py)
    prefill_ttft_s: float | None = None  # PREFILL_TTFT_ENV: the rule's TTFT clause; None: the floor alone

    @classmethod
    def from_server_args(cls, server_args: ServerArgs) -> BranchwiseConfig:
        """Read the patched ServerArgs fields; an unpatched SGLang gives the defaults (policy stock)."""
        defaults = cls()
        values = {name: getattr(server_args, name, getattr(defaults, name)) for name in cls.__slots__}
        env_policy = os.environ.get("BRANCHWISE_POLICY")  # for runs without `make apply`
        if env_policy and not hasattr(server_args, "branch_policy"):
            values["branch_policy"] = env_policy
        return cls(**(values | prefill_settings())).validated()

    def validated(self) -> BranchwiseConfig:
        parse_policy_name(self.branch_policy)
        parse_rho(self.taper_rho)
        parse_positive_ms(self.branch_slo_tpot_ms)
        if self.branch_min_slo_tpot_ms is not None:
            parse_positive_ms(self.branch_min_slo_tpot_ms)
        parse_max_fanout(self.branch_max_fanout)
        parse_max_branch_tokens(self.branch_max_branch_tokens)
        parse_grammar_clients(self.branch_grammar_clients)
        if self.emulate_device is not None:
            parse_emulate_device(self.emulate_device)
        if self.prefill_ttft_s is not None:
            parse_ttft_s(self.prefill_ttft_s)
            if not self.prefill_budget:
                raise ValueError(f"{PREFILL_TTFT_ENV} needs {PREFILL_ENV}=1")
        if self.taper_utility not in UTILITIES:
            raise ValueError(f"invalid --taper-utility {self.taper_utility!r}; valid: {', '.join(UTILITIES)}")
        if self.branch_grammar not in GRAMMARS:
            raise ValueError(f"invalid --branch-grammar {self.branch_grammar!r}; "
                             f"valid: {', '.join(GRAMMARS)}")
        return self

    @property
    def step_controller(self) -> bool:
        """Whether a per-step controller chooses rows (every policy but stock)."""
        return self.branch_policy != STOCK

    # ---- per-request bounds (one client must not set the others' budget) ----------------------
    @property
    def min_slo_tpot_ms(self) -> float:
        floor_ms = self.branch_min_slo_tpot_ms
        return floor_ms if floor_ms is not None else self.branch_slo_tpot_ms / 2

    def slo_s(self, requested_ms: float | None) -> float:
        """A request's TPOT SLO in seconds: its own or the default, bounded below by the minimum."""
        if requested_ms is None:
            return self.branch_slo_tpot_ms / 1e3
        return max(requested_ms, self.min_slo_tpot_ms) / 1e3

    @staticmethod
    def weight(requested: float) -> float:
        """A request's utility weight, bounded to [0, MAX_WEIGHT]."""
        return min(max(requested, 0.0), MAX_WEIGHT)

    def client_grammar_error(self, grammar: str | None) -> str | None:
        """Why a request may not name this grammar (HTTP 400, --branch-grammar-clients), or None."""
        if self.branch_grammar_clients == "allow" or grammar in (None, "none", self.branch_grammar):
            return None
        return (f"custom_params.branchwise.grammar {grammar!r} is not allowed on this server "
                f"(--branch-grammar-clients deny; server grammar: {self.branch_grammar!r})")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def log_line(self) -> str:
        return "Branchwise active: " + " ".join(f"{name}={value}" for name, value in self.as_dict().items())
