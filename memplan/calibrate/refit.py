"""Fit a profile from a records folder; re-fit every committed profile from its records.

    memplan calibrate --refit                 # every profile under calibration/profiles
    python -m memplan.calibrate.refit --check # the same, writing nothing: exit 1 on a change

The fit is deterministic, so a re-fit of unchanged records reproduces the committed profile.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from memplan.calibrate.calibration_profile import Profile, load_profile, save_profile
from memplan.calibrate.records import read_probes, read_records
from memplan.errors import MemplanError

DEFAULT_ROOT = Path("calibration")


def build_profile(folder: Path, profile_path: Path, name: str) -> Profile:
    """Fit the records in ``folder`` into a profile that will live at ``profile_path``."""
    records = read_records(folder)
    if not records:
        raise MemplanError(f"no calibration records in {folder}")
    meta = records[0].meta.model_copy(update={"date": max(r.meta.date for r in records)})
    rel = os.path.relpath(Path(folder).resolve(), Path(profile_path).resolve().parent)
    common = {"name": name, "meta": meta, "records": Path(rel).as_posix(),
              "num_records": len(records), "num_oom": sum(r.status == "oom" for r in records)}
    if all(r.kind == "model" for r in records):
        from memplan.calibrate.model_fit import fit_model

        terms, errors, points = fit_model(records)
        return Profile(kind="model", model=terms, errors=errors, points=points, **common)
    if any(r.kind == "model" for r in records):
        raise MemplanError(f"{folder} mixes user-model and grid records; keep them apart")
    from memplan.calibrate.fit import fit_device

    terms_d, errors, points = fit_device(records, read_probes(folder))
    return Profile(kind="device", device=terms_d, errors=errors, points=points, **common)


def refit(profile_path: Path) -> tuple[Profile, Profile]:
    """(committed, re-fitted) for one profile, from the records it names."""
    old = load_profile(profile_path)
    folder = (Path(profile_path).parent / old.records).resolve()
    return old, build_profile(folder, profile_path, old.name)


def same(a: object, b: object, rel: float = 1e-6) -> bool:
    """Equal JSON data, floats within ``rel`` (a different BLAS may round the last digits)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and \
            math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y, rel) for x, y in zip(a, b))
    return a == b


def refit_all(root: Path = DEFAULT_ROOT, *, write: bool = True) -> list[tuple[Path, bool]]:
    """Re-fit every profile under ``root/profiles``; (path, changed) for each."""
    folder = Path(root) / "profiles"
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise MemplanError(f"no calibration profiles under {folder}")
    out = []
    for path in paths:
        old, new = refit(path)
        changed = not same(old.model_dump(mode="json", exclude_none=True),
                           new.model_dump(mode="json", exclude_none=True))
        if changed and write:
            save_profile(path, new)
        out.append((path, changed))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memplan.calibrate.refit",
                                     description="Re-fit every profile from its records.")
    parser.add_argument("root", nargs="?", default=str(DEFAULT_ROOT))
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a re-fit differs from the file")
    args = parser.parse_args(argv)
    try:
        results = refit_all(Path(args.root), write=not args.check)
    except MemplanError as err:
        print(f"memplan: error: {err}", file=sys.stderr)
        return 2
    for path, changed in results:
        print(f"{path}: {'changed' if changed else 'unchanged'}"
              + (" (not written: --check)" if changed and args.check else ""))
    return 1 if args.check and any(c for _, c in results) else 0


if __name__ == "__main__":
    sys.exit(main())
