"""SGLang's own parallel samples (`n > 1`) as one Branchwise phase, stamped in the HTTP server process.
Design: docs/design/n-sampling.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from branchwise.request_meta import KEY, affinity_key, branch_rid

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
    from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager

EXPANSION = "_branchwise_expansion"  # on each prompt's sub-request, shared by SGLang's copies of it
SAMPLE = "_branchwise_sample"  # on the copy SGLang sends as the prefix pass or as one sample
PHASE_FIELDS = ("phase", "branch", "fanout")


@dataclass(slots=True, kw_only=True)
class Expansion:
    """One prompt of an n > 1 request: its phase and what each of its sends carries."""

    phase: str
    fanout: int
    stamp: dict[str, Any] | None  # each sample's stamp but `branch`; None: the client's own stamp stays
    routing_key: str | None
    calls: int = 0  # regenerate_rid calls so far: the prefix pass, then the samples in order


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    expansion: Expansion
    branch: int | None  # None: the prefix pass


def plan(rid: object, n: object, sampling_params: object) -> Expansion | None:
    """The expansion of one prompt of an n > 1 request, or None (SGLang's own n > 1: n < 2, no
    usable rid, an opt-out, or a malformed stamp, which validate.py has already refused)."""
    if not isinstance(rid, str) or not rid or not isinstance(n, int) or isinstance(n, bool) or n < 2:
        return None
    custom = sampling_params.get("custom_params") if isinstance(sampling_params, dict) else None
    own = custom.get(KEY) if isinstance(custom, dict) else None
    if own is None:
        own = {}
    if not isinstance(own, dict) or ("phase" in own and own["phase"] is None):
        return None
    if own.get("phase") is not None:  # the client placed these samples in its own phase
        return Expansion(phase=own["phase"], fanout=n, stamp=None, routing_key=affinity_key(custom))
    stamp = {key: value for key, value in own.items() if key not in PHASE_FIELDS}
    stamp |= {"phase": rid, "fanout": n}
    return Expansion(phase=rid, fanout=n, stamp=stamp, routing_key=affinity_key({KEY: stamp}))


def next_sample(expansion: Expansion) -> Sample:
    """The send behind the next regenerate_rid call of this prompt (SGLang's order)."""
    call = expansion.calls
    expansion.calls += 1
    return Sample(expansion=expansion, branch=call - 1 if 0 < call <= expansion.fanout else None)


def custom_params_for(sample: Sample, custom_params: object) -> dict[str, Any] | None:
    """custom_params of the request sent for `sample`: the phase stamp of sample i; for the prefix
    pass the client's stamp without phase fields (it decodes nothing and belongs to no phase)."""
    custom = dict(custom_params) if isinstance(custom_params, dict) else {}
    own = custom.get(KEY) if isinstance(custom.get(KEY), dict) else {}
    expansion = sample.expansion
    if sample.branch is None:
        rest = {key: value for key, value in own.items() if key not in PHASE_FIELDS}
        if rest:
            custom[KEY] = rest
        else:
            custom.pop(KEY, None)
    elif expansion.stamp is not None:
        custom[KEY] = expansion.stamp | {"branch": sample.branch}
    else:
        return custom_params
    return custom or None


# ---- hook bodies (HTTP server process; targets in plugin.py) ------------------------------------
def around_handle_batch_request(orig: Callable[..., Any], manager: TokenizerManager,
                                obj: GenerateReqInput, *args: Any, **kwargs: Any) -> Any:
    n = getattr(obj, "parallel_sample_num", 1)
    if isinstance(n, int) and n > 1 and hasattr(obj, "sampling_params"):
        for i in range(obj.batch_size):
            sub = obj[i]  # SGLang caches the sub-request: _handle_batch_request copies this one
            expansion = plan(sub.rid, n, sub.sampling_params)
            if expansion is not None:
                setattr(sub, EXPANSION, expansion)
    return orig(manager, obj, *args, **kwargs)


def around_regenerate_rid(orig: Callable[..., str], obj: GenerateReqInput, *args: Any, **kwargs: Any) -> str:
    expansion = getattr(obj, EXPANSION, None)
    if not isinstance(expansion, Expansion):
        return orig(obj, *args, **kwargs)
    sample = next_sample(expansion)
    setattr(obj, SAMPLE, sample)
    if sample.branch is None:
        return orig(obj, *args, **kwargs)
    obj.rid = branch_rid(expansion.phase, sample.branch)
    return obj.rid


def around_send_one_request(orig: Callable[..., Any], manager: TokenizerManager,
                            tokenized: TokenizedGenerateReqInput, *args: Any, **kwargs: Any) -> Any:
    state = manager.rid_to_state.get(getattr(tokenized, "rid", None))
    sample = getattr(getattr(state, "obj", None), SAMPLE, None)
    if isinstance(sample, Sample):
        _stamp(tokenized, sample)
    return orig(manager, tokenized, *args, **kwargs)


def _stamp(tokenized: TokenizedGenerateReqInput, sample: Sample) -> None:
    import copy

    params = tokenized.sampling_params
    custom = custom_params_for(sample, params.custom_params)
    if custom is not params.custom_params:
        params = copy.copy(params)  # SGLang's copies of the request share one SamplingParams
        params.custom_params = custom
        tokenized.sampling_params = params
    if sample.expansion.routing_key is not None:
        tokenized.routing_key = sample.expansion.routing_key


def around_abort_request(orig: Callable[..., None], manager: TokenizerManager, rid: str = "",
                         abort_all: bool = False, *args: Any, **kwargs: Any) -> None:
    if not abort_all and isinstance(rid, str) and rid and rid not in manager.rid_to_state:
        for child in live_samples(manager.rid_to_state, rid):
            orig(manager, child, False, *args, **kwargs)
    return orig(manager, rid, abort_all, *args, **kwargs)


def live_samples(rid_to_state: dict[str, ReqState], prefix: str) -> list[str]:
    """Rids of the live n > 1 samples that `prefix` prefixes."""
    out = []
    for rid, state in list(rid_to_state.items()):
        sample = getattr(getattr(state, "obj", None), SAMPLE, None)
        if isinstance(sample, Sample) and sample.branch is not None and rid.startswith(prefix):
            out.append(rid)
    return out
