"""Apply, revert and check Branchwise's patch series on the installed SGLang."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

SGLANG_VERSION = "0.5.23"
DEFAULT_PATCHES = Path(__file__).resolve().parent / "patches" / f"sglang-{SGLANG_VERSION}"
STATE_NAME = "branchwise-patches"
# Unchanged SGLang frontend programs get Branchwise's fork hook in every process of the environment
# (lazy: the hook imports nothing until a program forks; env BRANCHWISE_FRONTEND_HOOK=0 opts out).
FRONTEND_PTH = "branchwise_frontend.pth"
FRONTEND_PTH_LINE = ("import os; os.environ.get('BRANCHWISE_FRONTEND_HOOK', '1') == '0' or "
                     "__import__('branchwise.frontend_hook').frontend_hook.install()\n")


class PatchError(RuntimeError):
    """The patch series cannot be applied, reverted or checked here; the message says why."""


@dataclass(frozen=True, slots=True)
class Target:
    site: Path  # site-packages holding sglang
    record: dict[str, str]  # relative path -> urlsafe-b64 sha256 from the wheel's RECORD
    state_dir: Path  # where pristine copies and the applied manifest live


def _sha(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def find_target() -> Target:
    try:
        dist = metadata.distribution("sglang")
    except metadata.PackageNotFoundError:
        raise PatchError(f"sglang is not installed in this environment ({sys.prefix}); install "
                         f"sglang=={SGLANG_VERSION} first (or `make install` in the checkout)") from None
    if dist.version != SGLANG_VERSION:
        raise PatchError(f"installed sglang is {dist.version}; these patches are for {SGLANG_VERSION} only")
    site = Path(str(dist.locate_file("")))
    record = {}
    for line in (dist.read_text("RECORD") or "").splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[1].startswith("sha256="):
            record[parts[0]] = parts[1].removeprefix("sha256=")
    return Target(site=site, record=record, state_dir=Path(sys.prefix) / STATE_NAME)


def bundled_patches() -> Path:
    """The series shipped in this package: the default of every command."""
    if not (DEFAULT_PATCHES / "series").is_file():
        raise PatchError(f"this Branchwise install has no bundled patch series at {DEFAULT_PATCHES} "
                         "(built without the checkout's patches/?); reinstall it from the repository "
                         "or pass --patches DIR")
    return DEFAULT_PATCHES


def series(patch_dir: Path) -> list[Path]:
    if not (patch_dir / "series").is_file():
        raise PatchError(f"{patch_dir} is not a patch series (no `series` file in it)")
    names = [line.strip() for line in (patch_dir / "series").read_text().splitlines()]
    return [patch_dir / name for name in names if name and not name.startswith("#")]


def touched_files(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)


def file_states(target: Target, patch_dir: Path) -> dict[str, str]:
    """Per touched file: 'pristine', 'applied' (matches what we wrote) or 'modified'."""
    applied = _applied_manifest(target)
    states = {}
    for patch in series(patch_dir):
        for rel in touched_files(patch):
            if rel not in target.record:
                raise PatchError(f"{patch.name} touches {rel}, which sglang {SGLANG_VERSION} does not ship")
            sha = _sha(target.site / rel)
            if sha == target.record[rel]:
                states[rel] = "pristine"
            elif applied.get(rel) == sha:
                states[rel] = "applied"
            else:
                states[rel] = "modified"
    return states


def _applied_manifest(target: Target) -> dict[str, str]:
    path = target.state_dir / "applied.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _run_patch(site: Path, patch: Path, *extra: str) -> None:
    if shutil.which("patch") is None:
        raise PatchError("the `patch` program is missing (apt-get install patch)")
    cmd = ["patch", "-p1", "--forward", "--no-backup-if-mismatch", "-r", "-",
           "-d", str(site), "-i", str(patch)]
    proc = subprocess.run([*cmd, *extra], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PatchError(f"{patch.name} does not apply cleanly:\n{proc.stdout}{proc.stderr}")


def series_digest(patch_dir: Path) -> str:
    """One digest of the series: its patches' names and bytes, in order."""
    h = hashlib.sha256()
    for patch in series(patch_dir):
        h.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return h.hexdigest()


def apply(patch_dir: Path = DEFAULT_PATCHES) -> str:
    target = find_target()
    (target.site / FRONTEND_PTH).write_text(FRONTEND_PTH_LINE)
    states = file_states(target, patch_dir)
    digest, stamp = series_digest(patch_dir), target.state_dir / "series.sha256"
    note = ""
    if states and all(state == "applied" for state in states.values()):
        if stamp.exists() and stamp.read_text() == digest:
            return f"already applied ({len(states)} files): nothing to do"
        # applied from another version of the series (an upgraded checkout): start from pristine
        _restore_pristine(target, states)
        states = file_states(target, patch_dir)
        note = " (replacing an earlier version of the series)"
    bad = {rel: state for rel, state in states.items() if state != "pristine"}
    if bad:
        raise PatchError(f"refusing to patch: files are not pristine sglang {SGLANG_VERSION}: {bad}")
    for patch in series(patch_dir):  # dry-run everything first so a failure changes nothing
        _run_patch(target.site, patch, "--dry-run")
    backup = target.state_dir / "pristine"
    for rel in states:
        dst = backup / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(target.site / rel, dst)
    for patch in series(patch_dir):
        _run_patch(target.site, patch)
    manifest = {rel: _sha(target.site / rel) for rel in states}
    (target.state_dir / "applied.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    stamp.write_text(digest)
    return f"applied {len(series(patch_dir))} patch(es) to {len(states)} file(s) in {target.site}{note}"


def _restore_pristine(target: Target, states: dict[str, str]) -> None:
    """Put back the pristine copy of every touched file, checked against sglang's RECORD."""
    backup = target.state_dir / "pristine"
    for rel, state in states.items():
        if state == "pristine":
            continue
        src = backup / rel
        if not src.exists():
            raise PatchError(f"no pristine copy of {rel}; reinstall sglang=={SGLANG_VERSION}")
        shutil.copy2(src, target.site / rel)
        if _sha(target.site / rel) != target.record[rel]:
            raise PatchError(f"restored {rel} does not match sglang's RECORD checksum")


def revert(patch_dir: Path = DEFAULT_PATCHES) -> str:
    target = find_target()
    (target.site / FRONTEND_PTH).unlink(missing_ok=True)
    states = file_states(target, patch_dir)
    if all(state == "pristine" for state in states.values()):
        return "not applied: sglang is already pristine"
    _restore_pristine(target, states)
    shutil.rmtree(target.state_dir, ignore_errors=True)
    return f"reverted {len(states)} file(s); checksums match sglang {SGLANG_VERSION}'s RECORD"


def check(patch_dir: Path = DEFAULT_PATCHES) -> tuple[str, int]:
    target = find_target()
    states = file_states(target, patch_dir)
    kinds = set(states.values())
    lines = [f"  {state:9s} {rel}" for rel, state in sorted(states.items())]
    if kinds == {"applied"}:
        head, rc = "state: applied", 0
    elif kinds == {"pristine"}:
        head, rc = "state: not applied (pristine)", 0
    else:
        head, rc = "state: inconsistent (some files modified or partly applied)", 2
    return "\n".join([head, *lines]), rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Branchwise patch series for sglang " + SGLANG_VERSION)
    ap.add_argument("action", choices=["apply", "revert", "check"])
    ap.add_argument("--patches", type=Path, default=None,
                    help="a patch series directory (default: the series bundled with this package)")
    args = ap.parse_args(argv)
    try:
        args.patches = bundled_patches() if args.patches is None else args.patches.resolve()
        if args.action == "check":
            text, rc = check(args.patches)
            print(text)
            return rc
        print((apply if args.action == "apply" else revert)(args.patches))
        return 0
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
