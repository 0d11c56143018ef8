"""request_meta.parse is total over JSON: any value is a RequestMeta or a MetaError naming the field."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise import request_meta
from branchwise.request_meta import KEY, MetaError, RequestMeta, parse, stamp

FIELDS = ("phase", "branch", "fanout", "slo_tpot_ms", "weight", "grammar")
EDGE_NUMBERS = [0, 1, -1, 0.5, 2**31 - 1, 2**31, 2**63, 2**64, 10**300, 10**400, -(10**400), 1e308,
                math.inf, -math.inf, math.nan, 1e-3, 1e-4, 5e-324]

scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
           | st.sampled_from(EDGE_NUMBERS) | st.sampled_from(list(request_meta.GRAMMARS) + [KEY, ""]))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8) | st.sampled_from(FIELDS + (KEY,)), kids,
                                             max_size=4), max_leaves=12)
# shaped like a real stamp, so most examples get past the type checks to the value checks
stamps = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=6)
custom_params = (json_values | st.builds(lambda b, rest: {**rest, KEY: b}, stamps | json_values,
                                         st.dictionaries(st.text(max_size=6), json_values, max_size=2)))


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(custom_params)
def test_parse_any_json_is_meta_or_meta_error(cp):
    try:
        meta = parse(cp)
    except MetaError as e:
        msg = str(e)
        assert msg.startswith(("custom_params", "unknown custom_params")), msg
        assert len(msg) < 300, msg  # a clear message, not a dump of the value
        return
    assert isinstance(meta, RequestMeta)
    assert type(meta.branch) is int and type(meta.fanout) is int and 0 <= meta.branch < meta.fanout
    for v in (meta.slo_tpot_ms, meta.weight):
        assert v is None or (type(v) is float and math.isfinite(v))
    assert meta.grammar in (None, *request_meta.GRAMMARS)
    assert meta.phase is None or (isinstance(meta.phase, str) and meta.phase)


@pytest.mark.parametrize("cp, field", [
    ([1, 2], "custom_params must be an object"),
    (["branchwise"], "custom_params must be an object"),
    ("xbranchwisey", "custom_params must be an object"),
    (5, "custom_params must be an object"),
    (True, "custom_params must be an object"),
    ({KEY: "x"}, "custom_params.branchwise must be an object"),
    ({KEY: [1]}, "custom_params.branchwise must be an object"),
    ({KEY: {"fanout": 10**400}}, "custom_params.branchwise.fanout"),
    ({KEY: {"fanout": 10**5000}}, "custom_params.branchwise.fanout"),
    ({KEY: {"fanout": 1e30}}, "custom_params.branchwise.fanout"),
    ({KEY: {"fanout": 2.5}}, "custom_params.branchwise.fanout"),
    ({KEY: {"branch": 10**400}}, "custom_params.branchwise.branch"),
    ({KEY: {"weight": 10**400}}, "custom_params.branchwise.weight"),
    ({KEY: {"weight": math.nan}}, "custom_params.branchwise.weight"),
    ({KEY: {"slo_tpot_ms": 10**400}}, "custom_params.branchwise.slo_tpot_ms"),
    ({KEY: {"slo_tpot_ms": math.inf}}, "custom_params.branchwise.slo_tpot_ms"),
    ({KEY: {"slo_tpot_ms": "50"}}, "custom_params.branchwise.slo_tpot_ms"),
    ({KEY: {"phase": ""}}, "custom_params.branchwise.phase"),
    ({KEY: {"phase": 3}}, "custom_params.branchwise.phase"),
    ({KEY: {"grammar": ["multiverse"]}}, "custom_params.branchwise.grammar"),
    ({KEY: {"phase": "p", "branch": True, "fanout": 2}}, "custom_params.branchwise.branch"),
])
def test_malformed_values_name_the_field(cp, field):
    with pytest.raises(MetaError, match="^" + field.replace(".", r"\.")):
        parse(cp)


def test_well_formed_stamps_and_absent_meta():
    assert parse(None) is parse({}) is parse({"other": [1]}) is parse({KEY: None}) is request_meta.SERIAL
    m = parse({KEY: {"phase": "g", "branch": 3.0, "fanout": 4, "slo_tpot_ms": 40, "weight": 0,
                     "grammar": "sprint"}})
    assert m == RequestMeta(phase="g", branch=3, fanout=4, slo_tpot_ms=40.0, weight=0.0, grammar="sprint")
    assert type(m.branch) is int and type(m.slo_tpot_ms) is float


def test_stamp_rejects_a_malformed_existing_custom_params():
    for sp in ({"custom_params": [1]}, {"custom_params": {KEY: "x"}}, {"custom_params": "branchwise"}):
        with pytest.raises(MetaError, match="^custom_params"):
            stamp(sp, phase="g", branch=0, fanout=2)
    assert stamp({"custom_params": {KEY: None}}, grammar="sprint")["custom_params"] == {KEY: {"grammar": "sprint"}}


def test_http_side_hooks_answer_400_for_any_client_error():
    from branchwise.ingress import validate

    class Obj:
        sampling_params = [{"custom_params": {KEY: {"fanout": 0}}}]

    def orig(self, *a, **kw):
        raise TypeError("SamplingParams.__init__() got an unexpected keyword argument 'choice'")

    with pytest.raises(MetaError, match=r"custom_params\.branchwise\.fanout"):
        validate.around_normalize_batch_and_arguments(lambda s: None, Obj())
    Obj.sampling_params = {"custom_params": {}}
    with pytest.raises(ValueError, match="invalid request \\(TypeError: .*'choice'\\)"):
        validate.around_normalize_batch_and_arguments(orig, Obj())
    with pytest.raises(ValueError, match="OverflowError"):
        validate.around_create_tokenized_object(lambda s, o: 2**64 < float(10**400), object(), Obj())
    with pytest.raises(ValueError, match="^top_p") as e:  # SGLang's own 400s pass through unchanged
        validate.around_create_tokenized_object(lambda s, o: (_ for _ in ()).throw(ValueError("top_p")), object(), Obj())
    assert type(e.value) is ValueError
    assert validate.around_create_tokenized_object(lambda s, o, x: x + 1, object(), Obj(), 1) == 2


def test_n_is_an_integer_in_range_before_sglang_copies_the_request():
    from branchwise.ingress import validate

    for n in (1, 2, validate.MAX_N):
        validate.check_sampling_params({"n": n})
    validate.check_sampling_params({})
    for sp in ({"n": validate.MAX_N + 1}, [{}, {"n": 2**40}], {"n": 0}, {"n": -2}, {"n": 2.5}, {"n": 2.0},
               {"n": "3"}, {"n": [2]}, {"n": True}, {"n": None}, {"n": 10**400}):
        with pytest.raises(ValueError, match=r"^sampling_params.n must be an integer in \[1, 128\]"):
            validate.check_sampling_params(sp)


def test_values_that_would_make_the_sampler_logits_infinite_are_refused():
    from branchwise.ingress import validate

    validate.check_sampling_params({"logit_bias": {"5": -1e30, "6": 100}, "repetition_penalty": 1e-6})
    validate.check_sampling_params({"logit_bias": {"5": "x"}, "repetition_penalty": 0})  # SGLang's own 400s
    for sp, field in (({"logit_bias": {"5": 1e308}}, "logit_bias"), ({"logit_bias": {"1": 1, "5": -(10**40)}}, "logit_bias"),
                      ({"repetition_penalty": 1e-300}, "repetition_penalty")):
        with pytest.raises(ValueError, match=f"^sampling_params.{field}"):
            validate.check_sampling_params(sp)


def test_values_that_overflow_scheduler_tensors_are_refused():
    from branchwise.ingress import validate

    validate.check_sampling_params({"top_k": 2**30, "min_new_tokens": 2**31 - 1})
    class Sub:
        def __init__(self, ids=(), k=None):
            self.sampling_params, self.top_logprobs_num = {"stop_token_ids": list(ids)}, k

    validate.check_vocab_bounds(Sub([0, 99], 100), 100)
    for sp, field in (({"top_k": 2**31}, "top_k"), ({"min_new_tokens": 2**31}, "min_new_tokens")):
        with pytest.raises(ValueError, match=f"^sampling_params.{field}"):
            validate.check_sampling_params(sp)
    for ids in ([100], [-1], [10**30]):
        with pytest.raises(ValueError, match="^sampling_params.stop_token_ids"):
            validate.check_vocab_bounds(Sub(ids), 100)
    for k in (101, -1, 2**40):
        with pytest.raises(ValueError, match="^top_logprobs_num"):
            validate.check_vocab_bounds(Sub(k=k), 100)


def test_a_request_refused_before_normalization_leaves_nothing_to_abort():
    from branchwise.ingress import validate

    class Obj:
        rid = ["unhashable"]
        sampling_params = {"custom_params": ["branchwise"]}

    obj = Obj()
    with pytest.raises(MetaError):
        validate.around_normalize_batch_and_arguments(lambda s: None, obj)
    assert obj.is_single is False and obj.rid == []


def test_an_empty_prompt_is_refused():
    from branchwise.ingress import validate

    class TM:
        class model_config:
            vocab_size = 100

    obj = type("Obj", (), {"sampling_params": {}, "top_logprobs_num": 0})()
    with pytest.raises(ValueError, match="prompt is empty"):
        validate.around_create_tokenized_object(lambda *a: None, TM(), obj, "", [], None, None)
    assert validate.around_create_tokenized_object(lambda *a: "ok", TM(), obj, "hi", [5], None, None) == "ok"
    assert validate.around_create_tokenized_object(lambda *a: "mm", TM(), obj, "", [], None, object()) == "mm"


def test_rids_are_strings_after_normalization():
    from branchwise.ingress import validate

    def normalize(obj):
        obj.is_single = isinstance(obj.text, str)

    for text, rid, ok in (("hi", "a", True), ("hi", ["a", "b"], False), (["a", "b"], ["x", "y"], True),
                          (["a", "b"], [1, 2], False), (["a"], "x", False)):
        obj = type("Obj", (), {"sampling_params": {}, "text": text, "rid": rid})()
        if ok:
            validate.around_normalize_batch_and_arguments(normalize, obj)
        else:
            with pytest.raises(ValueError, match="^rid must be a string"):
                validate.around_normalize_batch_and_arguments(normalize, obj)
            assert obj.is_single is False and obj.rid == []
