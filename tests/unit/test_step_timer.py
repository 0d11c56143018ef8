"""Step timer accounting and the overhead bench's summary, on synthetic iterations."""

from __future__ import annotations

import json
import time

from bench.overhead import summarize
from branchwise.step_timer import StepTimer


def test_nested_spans_are_exclusive_and_records_flush_when_idle(tmp_path):
    path = tmp_path / "steps.jsonl"
    t = StepTimer(str(path))
    t.begin_iteration(time.perf_counter())
    t.run = ["decode", 4]
    t.enter("prep")
    time.sleep(0.01)
    t.enter("forward")
    time.sleep(0.03)
    t.exit()
    t.exit()
    t.res = ["decode", 4]
    t.add_worker(0.005)
    t.begin_iteration(time.perf_counter())  # busy iteration: buffered, not written yet
    assert not path.exists()
    t.begin_iteration(time.perf_counter())  # the idle one flushes
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    busy, idle = recs
    assert busy["run"] == busy["res"] == ["decode", 4] and idle["run"] is None and idle["res"] is None
    assert busy["forward"] >= 0.03 and busy["prep"] >= 0.01
    assert busy["prep"] + busy["forward"] <= busy["wall"]  # exclusive: prep does not count forward
    assert busy["worker"] == 0.005 and idle["worker"] == 0.0
    assert busy["cpu"]["forward"] < 0.01  # sleeping is not CPU time


def test_summary_takes_steady_decode_steps_only():
    def rec(run, res, fwd, result, wall):
        spans = {"recv": 0.0, "sched": 0.001, "prep": 0.001, "forward": fwd, "sample": 0.0005,
                 "result": result, "stream": 0.0002, "worker": 0.0}
        return {**spans, "wall": wall, "run": run, "res": res, "cpu": {**spans, "wall": wall}}

    recs = [rec(["extend", 8], None, 0.05, 0.0, 0.06),  # prefill: not a decode step
            rec(["decode", 8], ["extend", 8], 0.01, 0.002, 0.02),  # first decode: processes the prefill
            rec(["decode", 8], ["decode", 8], 0.010, 0.002, 0.015),
            rec(["decode", 8], ["decode", 8], 0.012, 0.002, 0.017),
            rec(["decode", 4], ["decode", 8], 0.009, 0.002, 0.013),  # shrinking: mixed sizes
            rec(None, ["decode", 4], 0.0, 0.002, 0.003)]
    n, med, share = summarize(recs, 8)
    assert n == 2
    assert abs(med["wall"] - 16.0) < 1e-9 and abs(med["forward"] - 11.0) < 1e-9
    assert abs(med["exposed"] - 5.0) < 1e-9  # wall - forward
    assert abs(med["result"] - 2.2) < 1e-9  # T5 includes its send part
    assert abs(med["other"] - (16.0 - 11.0 - 1.0 - 1.0 - 0.5 - 2.2)) < 1e-9
    assert abs(sum(share[c] for c in ("sched", "prep", "forward", "sample", "result", "other")) - 1.0) < 1e-9


def test_build_wires_the_timer_where_its_hooks_and_albireos_workers_find_it(tmp_path, monkeypatch):
    """Off without the env; on, a fresh records file, and the hooks whose `self` is not the Scheduler
    (model runner; output streamer through its tree cache) and the send / forward workers reach it."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context

    from branchwise import step_timer
    from branchwise.albireo.async_output import OrderedSender
    from branchwise.albireo.forward_thread import ForwardExecutor

    monkeypatch.setattr(runtime_context, "get_parallel", lambda: SimpleNamespace(tp_rank=1))
    monkeypatch.setenv(step_timer.FILE_ENV, str(tmp_path))
    sender = OrderedSender(SimpleNamespace(socket=None), name="test-sender")
    forward = ForwardExecutor(scheduler=None)
    runner, tree = SimpleNamespace(), SimpleNamespace()
    sched = SimpleNamespace(server_args=SimpleNamespace(port=4321), tp_worker=SimpleNamespace(model_runner=runner),
                            tree_cache=tree,
                            branchwise=SimpleNamespace(async_output=SimpleNamespace(sender=sender), forward=forward))
    monkeypatch.delenv(step_timer.ENV, raising=False)
    assert step_timer.build(sched, None) is None and not vars(runner)
    path = tmp_path / "branchwise-steps-4321-tp1.jsonl"
    path.write_text("old run\n")
    monkeypatch.setenv(step_timer.ENV, "albireo")
    t = step_timer.build(sched, None)
    assert t.path == str(path) and path.read_text() == ""
    assert getattr(runner, step_timer.ATTR) is t and getattr(tree, step_timer.ATTR) is t
    assert sender.timer is t and forward.timer is t
    streamer = SimpleNamespace(tree_cache=tree)
    t.begin_iteration(time.perf_counter())
    step_timer.around_stream_output(lambda s, reqs: time.sleep(0.01), streamer, [])
    assert t.spans["stream"] >= 0.01
    sender.close()
    forward.close()


def test_taper_spans_are_carved_out_of_their_sglang_span_and_tagged(tmp_path):
    from branchwise import step_timer

    t = StepTimer(str(tmp_path / "steps.jsonl"))
    t.begin_iteration(time.perf_counter())
    t.enter("sched")
    step_timer.switch(t, "taper_rows")
    time.sleep(0.002)
    step_timer.switch(t, "taper_plan")
    time.sleep(0.004)
    step_timer.carve(t, "taper_planner", 0.003)  # of the plan's 4 ms, 3 were the policy's
    step_timer.switch(t, None)
    step_timer.tag(t, "deferred", 3)
    time.sleep(0.001)
    t.exit()
    t.launch, t.run = [7, 1.5], ["decode", 4]
    t.begin_iteration(time.perf_counter())
    rec = json.loads(t.buf[0])
    assert rec["taper_rows"] >= 0.002 and rec["taper_planner"] == 0.003 and rec["taper_plan"] >= 0.001
    assert rec["sched"] >= 0.001  # its own millisecond; the TAPER spans are not in it (exclusive):
    assert sum(rec[k] for k in ("sched", "taper_rows", "taper_plan", "taper_planner")) <= rec["wall"]
    assert rec["tags"] == {"deferred": 3} and rec["launch"] == [7, 1.5] and rec["runq"] >= 0.0
    step_timer.switch(None, "taper_rows")  # no timer (normal serving): nothing happens
    step_timer.carve(None, "taper_planner", 1.0)


def test_step_account_counts_consecutive_decode_launches_and_adds_up():
    from bench.step_account import account, equal_rows, steps

    def rec(it, ts, rows, phase=True, fwd=0.002, wall=0.003, res="decode"):
        spans = dict.fromkeys(("recv", "sched", "prep", "sample", "result", "stream", "taper_rows", "taper_plan",
                               "taper_planner", "taper_subset", "taper_deliver"), 0.0001)
        return {**spans, "forward": fwd, "wall": wall, "runq": 0.0, "run": ["decode", rows], "res": [res, rows],
                "launch": [it, ts], "tags": {"phase_rows": 1} if phase else {},
                "cpu": {**spans, "forward": fwd, "wall": wall}}

    recs = [rec(1, 0.0, 4), rec(2, 0.003, 4), rec(3, 0.006, 4, phase=False), rec(5, 0.012, 4), rec(6, 0.015, 5)]
    counted = steps(recs)
    assert [r["launch"][0] for r in counted] == [2, 6]  # a serial step and a gap in forward_iter do not count
    acc = account(counted)
    assert abs(acc["ms"]["step"] - 3.0) < 1e-9 and abs(acc["spans_ms"] - 3.1) < 1e-9  # 2 + 11 spans of 0.1
    assert abs(acc["rows"] - 4.5) < 1e-9
    many = [rec(i, 0.003 * i, 4) for i in range(1, 60)]
    eq = equal_rows(steps(many), steps(many))
    assert eq["points"][0]["rows"] == 4 and eq["mean_diff_ms"] == 0.0 and eq["cpu_diff_ms"] == 0.0
