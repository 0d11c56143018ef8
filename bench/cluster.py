"""The Branchwise counters of every scheduler behind a URL: one server, one server with --dp-size N,
or an smg router's workers (README "Scale-out"), one row per worker and DP rank, and the cluster.

    python -m bench.cluster --url http://127.0.0.1:30000 [--json FILE]

smg's own /get_server_info answers from one worker only, so the rows come from each worker's
/server_info (the worker URLs from the router's /workers). Columns: branch requests the scheduler
created, all requests it created, TAPER decode steps, branch rows run and deferred, opportunistic
rows admitted / offered, and the client phases whose requests it created (`phase_rows`, its most
recent 256). A phase whose requests reached more than one scheduler is counted as split.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from bench.report import Col, key, render, write_json
from branchwise.tools.launch import merge_reports, scheduler_states

COUNTS = (("branch_req", ("counters", "branch_requests")), ("requests", ("counters", "requests_created")),
          ("steps", ("taper", "steps")), ("rows_run", ("taper", "rows_run")),
          ("deferred", ("taper", "rows_deferred")), ("admitted", ("taper", "admitted")),
          ("offered", ("taper", "candidates")))


def row(rep: dict[str, Any]) -> dict[str, Any]:
    """One scheduler's (or the merged cluster's) table row from its Branchwise report."""
    out = {name: (rep.get(section) or {}).get(field, 0) for name, (section, field) in COUNTS}
    out["phases"] = len(rep.get("phase_rows") or {})
    return out


def cluster_rows(states: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """{"worker dp=N": row, ..., "cluster": row} and the phase counts (phases, split) of `states`."""
    reps = [(state["worker"], state["branchwise"]) for state in states if "branchwise" in state]
    rows = {f"{worker} dp={rep.get('dp_rank', 0)}": row(rep) for worker, rep in reps}
    seen = Counter(phase for _, rep in reps for phase in rep.get("phase_rows") or {})
    rows["cluster"] = row(merge_reports([rep for _, rep in reps])) | {"phases": len(seen)}
    return rows, {"phases": len(seen), "split": sum(count > 1 for count in seen.values())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True,
                        help="a Branchwise server or an smg router in front of several")
    parser.add_argument("--json", type=Path, help="also write the rows and phase counts to this file")
    args = parser.parse_args(argv)
    rows, phases = cluster_rows(scheduler_states(args.url))
    cols = [Col(name, 11, key(name, nd=0)) for name, _ in COUNTS] + [Col("phases", 8, key("phases", nd=0))]
    print(render(rows, cols, name="scheduler", name_width=max(map(len, rows)) + 2))
    print(f"client phases: {phases['phases']}, on more than one scheduler: {phases['split']}")
    if args.json:
        write_json(args.json, {"url": args.url, "rows": rows, "phases": phases}, indent=1)


if __name__ == "__main__":
    main()
