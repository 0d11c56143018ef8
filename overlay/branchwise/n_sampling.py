"""SGLang's own parallel samples (`n > 1`) as one Branchwise phase, stamped in the HTTP server process.

SGLang expands an `n > 1` request per prompt into a prefix pass and n copies with fresh uuids, which
the scheduler would see as n unrelated serial requests. Four hooks make them one phase: each
prompt's sub-request gets an `Expansion` (phase id = the prompt's rid, fanout n, the client's
SLO/weight/grammar, a routing key); sample i gets rid f"{phase}/b{i}/0" instead of a uuid (so keyed
seeds follow the client's rid and abort-by-prefix reaches every sample); each sample is sent
stamped, the prefix pass unstamped, both with the routing key; and an abort of the client's rid
ends every live sample it prefixes. A stamp naming a phase is kept; `phase = null` opts out.
The pure part (`plan`) imports no SGLang. The hooks in detail: docs/design/n-sampling.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from branchwise.dp_dispatch import affinity_key
from branchwise.request_meta import KEY

EXPANSION = "_branchwise_expansion"  # on each prompt's sub-request, shared by SGLang's copies of it
SAMPLE = "_branchwise_sample"  # on the copy SGLang sends as the prefix pass or as one sample
PHASE_FIELDS = ("phase", "branch", "fanout")


@dataclass(slots=True)
class Expansion:
    """One prompt of an n > 1 request: its phase and what each of its sends carries."""

    phase: str
    fanout: int
    stamp: dict[str, Any] | None  # each sample's stamp but `branch`; None: the client's own stamp stays
    routing_key: str | None
    calls: int = 0  # regenerate_rid calls so far: the prefix pass, then the samples in order


@dataclass(frozen=True, slots=True)
class Sample:
    expansion: Expansion
    branch: int | None  # None: the prefix pass


def plan(rid: Any, n: Any, sampling_params: Any) -> Expansion | None:
    """The expansion of one prompt of an n > 1 request, or None (SGLang's own n > 1: n < 2, no
    usable rid, an opt-out, or a malformed stamp, which validate.py has already refused)."""
    if not isinstance(rid, str) or not rid or not isinstance(n, int) or isinstance(n, bool) or n < 2:
        return None
    cp = sampling_params.get("custom_params") if isinstance(sampling_params, dict) else None
    own = cp.get(KEY) if isinstance(cp, dict) else None
    if own is None:
        own = {}
    if not isinstance(own, dict) or ("phase" in own and own["phase"] is None):
        return None
    if own.get("phase") is not None:  # the client placed these samples in its own phase
        return Expansion(own["phase"], n, None, affinity_key(cp))
    stamp = {k: v for k, v in own.items() if k not in PHASE_FIELDS} | {"phase": rid, "fanout": n}
    return Expansion(rid, n, stamp, affinity_key({KEY: stamp}))


def next_sample(exp: Expansion) -> Sample:
    """The send behind the next regenerate_rid call of this prompt (SGLang's order)."""
    k = exp.calls
    exp.calls += 1
    return Sample(exp, k - 1 if 0 < k <= exp.fanout else None)


def custom_params_for(sample: Sample, custom_params: Any) -> dict[str, Any] | None:
    """custom_params of the request sent for `sample`: the phase stamp of sample i; for the prefix
    pass the client's stamp without phase fields (it decodes nothing and belongs to no phase)."""
    cp = dict(custom_params) if isinstance(custom_params, dict) else {}
    own = cp.get(KEY) if isinstance(cp.get(KEY), dict) else {}
    exp = sample.expansion
    if sample.branch is None:
        rest = {k: v for k, v in own.items() if k not in PHASE_FIELDS}
        if rest:
            cp[KEY] = rest
        else:
            cp.pop(KEY, None)
    elif exp.stamp is not None:
        cp[KEY] = exp.stamp | {"branch": sample.branch}
    else:
        return custom_params
    return cp or None


# ---- hook bodies (HTTP server process; targets in plugin.py) ------------------------------------
def around_handle_batch_request(orig: Any, tm: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    n = getattr(obj, "parallel_sample_num", 1)
    if isinstance(n, int) and n > 1 and hasattr(obj, "sampling_params"):
        for i in range(obj.batch_size):
            sub = obj[i]  # SGLang caches the sub-request: _handle_batch_request copies this one
            exp = plan(sub.rid, n, sub.sampling_params)
            if exp is not None:
                setattr(sub, EXPANSION, exp)
    return orig(tm, obj, *args, **kwargs)


def around_regenerate_rid(orig: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    exp = getattr(obj, EXPANSION, None)
    if not isinstance(exp, Expansion):
        return orig(obj, *args, **kwargs)
    sample = next_sample(exp)
    setattr(obj, SAMPLE, sample)
    if sample.branch is None:
        return orig(obj, *args, **kwargs)
    from branchwise.client import branch_rid

    obj.rid = branch_rid(exp.phase, sample.branch)
    return obj.rid


def around_send_one_request(orig: Any, tm: Any, tokenized: Any, *args: Any, **kwargs: Any) -> Any:
    state = tm.rid_to_state.get(getattr(tokenized, "rid", None))
    sample = getattr(getattr(state, "obj", None), SAMPLE, None)
    if isinstance(sample, Sample):
        _stamp(tokenized, sample)
    return orig(tm, tokenized, *args, **kwargs)


def _stamp(tokenized: Any, sample: Sample) -> None:
    import copy

    sp = tokenized.sampling_params
    cp = custom_params_for(sample, sp.custom_params)
    if cp is not sp.custom_params:
        sp = copy.copy(sp)  # SGLang's copies of the request share one SamplingParams
        sp.custom_params = cp
        tokenized.sampling_params = sp
    if sample.expansion.routing_key is not None:
        tokenized.routing_key = sample.expansion.routing_key


def around_abort_request(orig: Any, tm: Any, rid: str = "", abort_all: bool = False, *args: Any,
                         **kwargs: Any) -> Any:
    if not abort_all and isinstance(rid, str) and rid and rid not in tm.rid_to_state:
        for child in live_samples(tm.rid_to_state, rid):
            orig(tm, child, False, *args, **kwargs)
    return orig(tm, rid, abort_all, *args, **kwargs)


def live_samples(rid_to_state: dict[str, Any], prefix: str) -> list[str]:
    """Rids of the live n > 1 samples that `prefix` prefixes."""
    out = []
    for rid, state in list(rid_to_state.items()):
        sample = getattr(getattr(state, "obj", None), SAMPLE, None)
        if isinstance(sample, Sample) and sample.branch is not None and rid.startswith(prefix):
            out.append(rid)
    return out
