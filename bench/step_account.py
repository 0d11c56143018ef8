"""Where a loaded server's decode step goes: forward, SGLang's scheduler work, Branchwise's, and
the time lost to other processes, per policy, against the launch-to-launch step.

    BRANCHWISE_STEP_TIMER=1 BRANCHWISE_STEP_TIMER_FILE=DIR python -m bench.sweep --launch \\
        --policies off,eager,taper --loads 0.4 --seed 3 --out DIR/sweep
    python -m bench.step_account DIR [--out FILE] [--against eager]

Reads each server's per-iteration records (branchwise/step_timer.py; its `.meta.json` names the
policy). A step counts when its iteration and the one before both launched a decode batch
(consecutive forward_iter) and the TAPER hook saw phase rows in it (the load, not the probe's
serial streams). Its launch-to-launch time is what the controller observes; the iteration's spans
(exclusive, wall clock) split it. `runq` is the part of the iteration the scheduler thread waited for
a core (schedstat): time other processes took, spread over the spans. The equal-rows table compares
the median non-forward time (iteration wall - forward) of steady steps (the previous result was a
decode too) at each rows-run count both policies ran at least MIN_STEPS times.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

try:
    import branchwise  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))

from bench.report import write_json  # noqa: E402
from branchwise.step_timer import TAPER_SPANS  # noqa: E402

MIN_STEPS = 20
SGLANG = ("recv", "sched", "prep", "sample", "result", "stream")
COLUMNS = ("step", "wall", "forward", *SGLANG, *TAPER_SPANS, "glue", "runq")


def load(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """policy -> records of every server in `folder` that wrote a meta file."""
    out: dict[str, list[dict[str, Any]]] = {}
    for meta_path in sorted(folder.glob("branchwise-steps-*.jsonl.meta.json")):
        meta = json.loads(meta_path.read_text())
        policy = (meta.get("config") or {}).get("branch_policy", meta_path.name)
        recs_path = Path(str(meta_path)[: -len(".meta.json")])
        lines = recs_path.read_text().splitlines() if recs_path.exists() else []
        out[policy] = [json.loads(x) for x in lines if x.strip()]
    return out


def steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The counted steps (module docstring), each its record plus `step` (launch-to-launch, s)."""
    out = []
    for prev, rec in itertools.pairwise(records):
        a, b = prev.get("launch"), rec.get("launch")
        if not (a and b and a[0] is not None and b[0] == a[0] + 1 and prev["run"] and rec["run"]):
            continue
        if prev["run"][0] != "decode" or rec["run"][0] != "decode" or not rec.get("tags", {}).get("phase_rows"):
            continue
        out.append(rec | {"step": b[1] - a[1]})
    return out


def account(counted: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean ms per step of each column; rows run and deferred per step; how the spans add up."""
    mean = {c: 1e3 * statistics.fmean(r.get(c, 0.0) for r in counted) for c in COLUMNS if c not in ("glue",)}
    spans = sum(mean[c] for c in ("forward", *SGLANG, *TAPER_SPANS))
    mean["glue"] = mean["wall"] - spans
    rows = statistics.fmean(r["run"][1] for r in counted)
    return {"steps": len(counted), "ms": mean, "rows": rows,
            "deferred": statistics.fmean(r.get("tags", {}).get("deferred", 0) for r in counted),
            "forward_per_row_ms": mean["forward"] / rows, "spans_ms": spans,
            "spans_vs_step": spans / mean["step"] - 1.0,
            "cpu_ms": 1e3 * statistics.fmean(r["cpu"]["wall"] for r in counted)}


def non_forward_by_rows(counted: list[dict[str, Any]]) -> dict[int, list[tuple[float, float, float]]]:
    """Steady steps by rows run: (wall - forward, the same in scheduler-thread CPU time, runq), ms."""
    by: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
    for r in counted:
        if r["res"] and r["res"][0] == "decode":
            cpu = r["cpu"]
            by[r["run"][1]].append((1e3 * (r["wall"] - r["forward"]), 1e3 * (cpu["wall"] - cpu["forward"]),
                                    1e3 * r["runq"]))
    return by


def equal_rows(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Median non-forward ms of policy a and b at each rows-run count both ran MIN_STEPS times, in
    wall and CPU time, and the differences a - b averaged over those counts (weighted by the fewer
    steps); `runq_diff_ms`: the same for the mean run-queue wait (time other processes took)."""
    ba, bb = non_forward_by_rows(a), non_forward_by_rows(b)
    points = []
    for n in sorted(set(ba) & set(bb)):
        if len(ba[n]) >= MIN_STEPS and len(bb[n]) >= MIN_STEPS:
            med = [[statistics.median(x[i] for x in side) for side in (ba[n], bb[n])] for i in (0, 1)]
            runq = [statistics.fmean(x[2] for x in side) for side in (ba[n], bb[n])]
            points.append({"rows": n, "steps": [len(ba[n]), len(bb[n])], "ms": med[0], "cpu_ms": med[1],
                           "runq_ms": runq})
    w = [min(p["steps"]) for p in points]

    def diff(field: str) -> float | None:
        if not w:
            return None
        return sum(wi * (p[field][0] - p[field][1]) for wi, p in zip(w, points, strict=True)) / sum(w)

    return {"points": points, "mean_diff_ms": diff("ms"), "cpu_diff_ms": diff("cpu_ms"),
            "runq_diff_ms": diff("runq_ms")}


def table(acc: dict[str, dict[str, Any]]) -> str:
    head = ("policy", "steps", "rows (deferred)", "step", "forward (per row)", "SGLang sched", "SGLang prep",
            "SGLang sample+result+stream+recv", "TAPER rows", "plan", "planner", "subset", "deliveries",
            "glue", "spans vs step", "runq", "CPU")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, a in acc.items():
        m = a["ms"]
        rest = m["sample"] + m["result"] + m["stream"] + m["recv"]
        cells = [policy, str(a["steps"]), f"{a['rows']:.1f} ({a['deferred']:.1f})", f"{m['step']:.3f}",
                 f"{m['forward']:.3f} ({a['forward_per_row_ms']:.3f})", f"{m['sched']:.3f}", f"{m['prep']:.3f}",
                 f"{rest:.3f}", f"{m['taper_rows']:.3f}", f"{m['taper_plan']:.3f}", f"{m['taper_planner']:.3f}",
                 f"{m['taper_subset']:.3f}", f"{m['taper_deliver']:.3f}", f"{m['glue']:.3f}",
                 f"{a['spans_vs_step']:+.1%}", f"{m['runq']:.3f}", f"{a['cpu_ms']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="BRANCHWISE_STEP_TIMER_FILE of the servers")
    ap.add_argument("--against", default="eager", help="the equal-rows baseline for every other policy")
    ap.add_argument("--out", help="write the accounting as JSON here")
    a = ap.parse_args(argv)
    counted = {p: steps(recs) for p, recs in load(Path(a.folder)).items()}
    counted = {p: c for p, c in counted.items() if c}
    if not counted:
        print(f"error: no counted decode steps under {a.folder}", file=sys.stderr)
        return 1
    acc = {p: account(c) for p, c in counted.items()}
    print("mean ms per decode step (launch to launch; spans exclusive, wall clock):\n" + table(acc))
    doc: dict[str, Any] = {"policies": acc, "equal_rows": {}}
    if a.against in counted:
        for p in counted:
            if p == a.against:
                continue
            eq = doc["equal_rows"][p] = equal_rows(counted[p], counted[a.against])
            pts = ", ".join(f"{x['rows']}: {x['ms'][0]:.3f}/{x['ms'][1]:.3f}" for x in eq["points"])
            print(f"\nnon-forward ms, {p} / {a.against}, median at equal rows run: {pts or 'no common counts'}")
            if eq["mean_diff_ms"] is not None:
                print(f"  {p} - {a.against} per step (mean over those counts): wall {eq['mean_diff_ms']:+.3f} ms, "
                      f"scheduler-thread CPU {eq['cpu_diff_ms']:+.3f} ms, run-queue wait {eq['runq_diff_ms']:+.3f} ms")
    if a.out:
        write_json(Path(a.out), doc, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
