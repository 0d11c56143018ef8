"""Where a loaded server's decode step goes: forward, SGLang's scheduler work, Branchwise's, and
the time lost to other processes, per policy, against the launch-to-launch step.

    BRANCHWISE_STEP_TIMER=1 BRANCHWISE_STEP_TIMER_FILE=DIR python -m bench.sweep --launch \\
        --policies serial,eager,taper --loads 0.4 --seed 3 --out DIR/sweep
    python -m bench.step_account DIR [--out FILE] [--against eager]

Reads each server's per-iteration records (branchwise/step_timer.py; its `.meta.json` names the
policy), keeps the loaded decode steps, and prints the mean ms per step of each span and, against
--against, the non-forward time at equal rows run. Which steps count, what `runq` is and how the
equal-rows table compares: docs/design/bench-tools.md.
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
        out[policy] = [json.loads(line) for line in lines if line.strip()]
    return out


def steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The counted steps, each its record plus `step` (launch-to-launch, s): this iteration and the
    one before both launched a decode batch (consecutive forward_iter) and the TAPER hook saw phase
    rows in it."""
    out = []
    for prev, rec in itertools.pairwise(records):
        prev_launch, launch = prev.get("launch"), rec.get("launch")
        if not (prev_launch and launch and prev_launch[0] is not None and launch[0] == prev_launch[0] + 1
                and prev["run"] and rec["run"]):
            continue
        if prev["run"][0] != "decode" or rec["run"][0] != "decode":
            continue
        if not rec.get("tags", {}).get("phase_rows"):
            continue
        out.append(rec | {"step": launch[1] - prev_launch[1]})
    return out


def account(counted: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean ms per step of each column; rows run and deferred per step; how the spans add up."""
    mean = {col: 1e3 * statistics.fmean(rec.get(col, 0.0) for rec in counted)
            for col in COLUMNS if col not in ("glue",)}
    spans = sum(mean[col] for col in ("forward", *SGLANG, *TAPER_SPANS))
    mean["glue"] = mean["wall"] - spans
    rows = statistics.fmean(rec["run"][1] for rec in counted)
    return {"steps": len(counted), "ms": mean, "rows": rows,
            "deferred": statistics.fmean(rec.get("tags", {}).get("deferred", 0) for rec in counted),
            "forward_per_row_ms": mean["forward"] / rows, "spans_ms": spans,
            "spans_vs_step": spans / mean["step"] - 1.0,
            "cpu_ms": 1e3 * statistics.fmean(rec["cpu"]["wall"] for rec in counted)}


def non_forward_by_rows(counted: list[dict[str, Any]]) -> dict[int, list[tuple[float, float, float]]]:
    """Steady steps by rows run: (wall - forward, the same in scheduler-thread CPU time, runq), ms."""
    by_rows: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
    for rec in counted:
        if rec["res"] and rec["res"][0] == "decode":
            cpu = rec["cpu"]
            by_rows[rec["run"][1]].append((1e3 * (rec["wall"] - rec["forward"]),
                                           1e3 * (cpu["wall"] - cpu["forward"]), 1e3 * rec["runq"]))
    return by_rows


def equal_rows(policy_steps: list[dict[str, Any]], base_steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median non-forward ms of the policy and the baseline at each rows-run count both ran
    MIN_STEPS times, in wall and CPU time, and the differences policy - baseline averaged over those
    counts (weighted by the fewer steps); `runq_diff_ms`: the same for the mean run-queue wait (time
    other processes took)."""
    policy_by_rows, base_by_rows = non_forward_by_rows(policy_steps), non_forward_by_rows(base_steps)
    points = []
    for rows in sorted(set(policy_by_rows) & set(base_by_rows)):
        sides = (policy_by_rows[rows], base_by_rows[rows])
        if len(sides[0]) >= MIN_STEPS and len(sides[1]) >= MIN_STEPS:
            med = [[statistics.median(sample[col] for sample in side) for side in sides] for col in (0, 1)]
            runq = [statistics.fmean(sample[2] for sample in side) for side in sides]
            points.append({"rows": rows, "steps": [len(sides[0]), len(sides[1])], "ms": med[0],
                           "cpu_ms": med[1], "runq_ms": runq})
    weights = [min(point["steps"]) for point in points]

    def diff(field: str) -> float | None:
        if not weights:
            return None
        return sum(weight * (point[field][0] - point[field][1])
                   for weight, point in zip(weights, points, strict=True)) / sum(weights)

    return {"points": points, "mean_diff_ms": diff("ms"), "cpu_diff_ms": diff("cpu_ms"),
            "runq_diff_ms": diff("runq_ms")}


def table(acc: dict[str, dict[str, Any]]) -> str:
    head = ("policy", "steps", "rows (deferred)", "step", "forward (per row)", "SGLang sched", "SGLang prep",
            "SGLang sample+result+stream+recv", "TAPER rows", "plan", "planner", "subset", "deliveries",
            "glue", "spans vs step", "runq", "CPU")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, policy_acc in acc.items():
        mean = policy_acc["ms"]
        rest = mean["sample"] + mean["result"] + mean["stream"] + mean["recv"]
        cells = [policy, str(policy_acc["steps"]), f"{policy_acc['rows']:.1f} ({policy_acc['deferred']:.1f})",
                 f"{mean['step']:.3f}", f"{mean['forward']:.3f} ({policy_acc['forward_per_row_ms']:.3f})",
                 f"{mean['sched']:.3f}", f"{mean['prep']:.3f}", f"{rest:.3f}", f"{mean['taper_rows']:.3f}",
                 f"{mean['taper_plan']:.3f}", f"{mean['taper_planner']:.3f}", f"{mean['taper_subset']:.3f}",
                 f"{mean['taper_deliver']:.3f}", f"{mean['glue']:.3f}", f"{policy_acc['spans_vs_step']:+.1%}",
                 f"{mean['runq']:.3f}", f"{policy_acc['cpu_ms']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="BRANCHWISE_STEP_TIMER_FILE of the servers")
    parser.add_argument("--against", default="eager", help="the equal-rows baseline for every other policy")
    parser.add_argument("--out", help="write the accounting as JSON here")
    args = parser.parse_args(argv)
    counted = {policy: steps(recs) for policy, recs in load(Path(args.folder)).items()}
    counted = {policy: policy_steps for policy, policy_steps in counted.items() if policy_steps}
    if not counted:
        print(f"error: no counted decode steps under {args.folder}", file=sys.stderr)
        return 1
    acc = {policy: account(policy_steps) for policy, policy_steps in counted.items()}
    print("mean ms per decode step (launch to launch; spans exclusive, wall clock):\n" + table(acc))
    doc: dict[str, Any] = {"policies": acc, "equal_rows": {}}
    base = args.against
    if base in counted:
        for policy in counted:
            if policy == base:
                continue
            comparison = doc["equal_rows"][policy] = equal_rows(counted[policy], counted[base])
            pts = ", ".join(f"{point['rows']}: {point['ms'][0]:.3f}/{point['ms'][1]:.3f}"
                            for point in comparison["points"])
            print(f"\nnon-forward ms, {policy} / {base}, median at equal rows run: "
                  f"{pts or 'no common counts'}")
            if comparison["mean_diff_ms"] is not None:
                print(f"  {policy} - {base} per step (mean over those counts): "
                      f"wall {comparison['mean_diff_ms']:+.3f} ms, "
                      f"scheduler-thread CPU {comparison['cpu_diff_ms']:+.3f} ms, "
                      f"run-queue wait {comparison['runq_diff_ms']:+.3f} ms")
    if args.out:
        write_json(Path(args.out), doc, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
