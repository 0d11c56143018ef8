"""Which SGLang modes Branchwise runs with, checked once at argument resolution, before a model loads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from branchwise.config import PREFILL_ENV, STOCK, BranchwiseConfig

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

# SGLang's last resolution step: every resolved value (speculative algorithm, attention DP width,
# CUDA graph config, device) is final when it has run. plugin.py wraps it.
LAST_RESOLUTION_STEP = "validate_deepep_v2_dispatch_token_budget"


@dataclass(frozen=True, slots=True)
class ServingModes:
    """The resolved SGLang settings the support rules read (defaults: SGLang's plain single-GPU loop)."""

    attn_dp_size: int = 1
    mlp_sync: bool = False  # batches synced across ranks: attention DP, MoE all-to-all, dense-TP MLP
    disaggregation_mode: str = "null"
    pdmux: bool = False
    pp_size: int = 1
    speculative_algorithm: str | None = None
    mixed_chunk: bool = False
    device: str = "cpu"
    tp_size: int = 1
    decode_cuda_graph: bool = False
    rl_on_policy_target: bool = False
    sampling_backend: str | None = None


@dataclass(frozen=True, slots=True)
class Mode:
    """One SGLang mode a Branchwise feature refuses: its name, the flags that turn it on, whether on."""

    name: str
    flags: str
    on: Callable[[ServingModes], bool]
    remedy: str = ""  # what else lifts the refusal; default: drop `flags`

    @property
    def instead(self) -> str:
        return self.remedy or f"drop {self.flags}"


def _mlp_sync_only(m: ServingModes) -> bool:
    return m.mlp_sync and m.attn_dp_size <= 1


def _speculative(m: ServingModes) -> bool:
    return m.speculative_algorithm is not None and m.speculative_algorithm.upper() != "NONE"


ATTN_DP = Mode("attention DP", "--attn-dp-size N", lambda m: m.attn_dp_size > 1)
MLP_SYNC = Mode("batches synced across ranks",
                "--moe-a2a-backend, --moe-dense-tp-size or --ep-join-mode scale", _mlp_sync_only)
SPECULATIVE = Mode("speculative decoding", "--speculative-algorithm", _speculative)
PD_DISAGG = Mode("PD disaggregation", "--disaggregation-mode", lambda m: m.disaggregation_mode != "null")
PDMUX = Mode("PD multiplexing", "--enable-pdmux", lambda m: m.pdmux)
PP = Mode("pipeline parallelism", "--pp-size N", lambda m: m.pp_size > 1)


# Modes in which a step controller's sub-batch is unsafe or unaccounted (why: code-notes.md).
POLICY_MODES: tuple[Mode, ...] = (
    ATTN_DP,
    MLP_SYNC,
    PD_DISAGG,
    PDMUX,
    PP,
    SPECULATIVE,
    Mode("mixed chunked prefill", "--enable-mixed-chunk", lambda m: m.mixed_chunk),
)

PREFILL_POLICY = "taper"  # the one policy whose slack and T(S) the prefill budget reads

# Modes --parallel-sampling does not cover (sp_sampler_hook._unsupported_mode; code-notes.md).
SAMPLING_MODES: tuple[Mode, ...] = (
    SPECULATIVE,
    ATTN_DP,
    MLP_SYNC,
    PD_DISAGG,
    PDMUX,
    PP,
    Mode("RL on-policy sampling", "--rl-on-policy-target", lambda m: m.rl_on_policy_target),
    Mode("the ascend sampling backend", "--sampling-backend ascend", lambda m: m.sampling_backend == "ascend"),
    Mode("decode CUDA graphs at TP > 1", "--tp N on a CUDA device",
         lambda m: m.device == "cuda" and m.tp_size > 1 and m.decode_cuda_graph,
         remedy="add --cuda-graph-backend-decode=disabled (graph-replayed decode batches keep "
                "SGLang's captured logits all-gather)"),
)


def policy_message(policy: str, mode: Mode) -> str:
    return (f"Branchwise: --branch-policy {policy} does not run with {mode.name} ({mode.flags}): "
            "per-step branch admission needs SGLang's plain decode loop. Use --branch-policy stock "
            f"(SGLang's own schedule, every mode), or {mode.instead}.")


def sampling_message(mode: Mode) -> str:
    return (f"Branchwise: --parallel-sampling does not run with {mode.name} ({mode.flags}). "
            f"Drop --parallel-sampling, or {mode.instead}.")


def prefill_message(policy: str) -> str:
    return (f"Branchwise: {PREFILL_ENV}=1 (the prefill budget) runs with --branch-policy {PREFILL_POLICY} "
            f"only, got --branch-policy {policy}: each chunk is sized by TAPER's slack and T(S). "
            f"Use --branch-policy {PREFILL_POLICY}, or unset {PREFILL_ENV}.")


def refusals(config: BranchwiseConfig, modes: ServingModes) -> list[str]:
    """Why this server must not start: one message per refused pair, empty when it may start."""
    out = []
    if config.branch_policy != STOCK:
        out += [policy_message(config.branch_policy, mode) for mode in POLICY_MODES if mode.on(modes)]
    if config.parallel_sampling:
        out += [sampling_message(mode) for mode in SAMPLING_MODES if mode.on(modes)]
    if config.prefill_budget and config.branch_policy != PREFILL_POLICY:
        out.append(prefill_message(config.branch_policy))
    return out


def check(config: BranchwiseConfig, modes: ServingModes) -> None:
    """ValueError carrying every refusal (SGLang's resolution reports it and the launcher exits)."""
    if why := refusals(config, modes):
        raise ValueError("\n".join(why))


def resolved_modes(server_args: ServerArgs) -> ServingModes:
    """The ServingModes of resolved arguments, as the scheduler will see them."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import attn_dp_enabled_of

    cfg = resolving_view(server_args)
    attn_dp = attn_dp_enabled_of(cfg)
    moe_gather = (not cfg.disable_attn_tp_gather
                  and (str(cfg.moe_a2a_backend) != "none" or cfg.moe_dense_tp_size is not None))
    graph = getattr(cfg.cuda_graph_config, "decode", None)
    return ServingModes(
        attn_dp_size=cfg.attn_dp_size if attn_dp else 1,
        mlp_sync=attn_dp or moe_gather,
        disaggregation_mode=str(cfg.disaggregation_mode),
        pdmux=bool(cfg.enable_pdmux),
        pp_size=cfg.pp_size,
        speculative_algorithm=cfg.speculative_algorithm,
        mixed_chunk=bool(cfg.enable_mixed_chunk),
        device=str(cfg.device).split(":", 1)[0],
        tp_size=cfg.tp_size,
        decode_cuda_graph=graph is not None and graph.backend != Backend.DISABLED,
        rl_on_policy_target=bool(getattr(cfg, "rl_on_policy_target", None)),
        sampling_backend=getattr(cfg, "sampling_backend", None),
    )


def guard_scheduler(scheduler: Any, config: BranchwiseConfig) -> None:
    """In the scheduler, behind the start-time check: a refused mode that got here stops it."""
    from branchwise import deferral

    if config.step_controller and (why := deferral.why_unsupported(scheduler)) is not None:
        raise RuntimeError(f"Branchwise: --branch-policy {config.branch_policy} does not run with {why}; "
                           "use --branch-policy stock (SGLang's own schedule, every mode)")


def around_last_resolution_step(server_args: ServerArgs, previous: Callable[[Any], None]) -> None:
    """SGLang's last resolution step, then the support check (a refusal fails the launch)."""
    previous(server_args)
    check(BranchwiseConfig.from_server_args(server_args), resolved_modes(server_args))
