"""Where memplan's step time goes for the published throughput runs: per run, the step's
seconds split into compute, pipeline bubble and exposed communication, each dimension's
communication before overlap, memplan's MFU next to the published one, the rate its
compute runs at (hardware FLOPs per GPU per second of compute over the dense BF16 peak), the
decoder linears' time factor from the measured GEMM rates by shape, and the rate the published
step leaves for the same FLOPs once memplan's bubble and exposed communication are taken out
(``throughput_table.breakdown``; a run published without a speed has none); then each group
of three runs or more, its rank correlation with a term of the step left out
(``throughput_table.term_rho``).

``python benchmarks/step_time_breakdown.py [ID-SUBSTRING ...]`` prints one row per run of
``benchmarks/data/throughput_runs.json`` whose id contains one of the substrings (all runs
without any), timed as ``benchmarks/throughput_table.py`` times them (uncalibrated).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import throughput_table as tt  # noqa: E402

HEADER = ("| run | published | memplan | step s | compute | bubble | exposed comm | tp | pp | dp "
          "| micro-batches | compute rate | GEMM shape factor | rate the published step leaves |")


def row(run: dict) -> str:
    """One run's breakdown, shares of the step."""
    b = tt.breakdown(run)
    if b is None:
        return f"| {run['id']} | refused |"
    est, st = b["est"], b["st"]
    _, pub, mine, _, _ = tt.predict(run)
    share = {k: v / st.step_s for k, v in st.comm_s.items()}
    left = "-" if b["left_rate"] is None else f"{b['left_rate']:.3f}"
    return (f"| {run['id']} | {tt._num('mfu' if pub < 1 else 'x', pub)} | "
            f"{tt._num('mfu' if pub < 1 else 'x', mine)} | {st.step_s:.3f} | "
            f"{st.compute_s / st.step_s:.1%} | {st.bubble_s / st.step_s:.1%} | "
            f"{st.exposed_comm_s / st.step_s:.1%} | {share['tp']:.1%} | {share['pp']:.1%} | "
            f"{share['dp']:.1%} | {est.num_microbatches} | {b['rate']:.3f} | "
            f"{b['linear']:.3f} | {left} |")


def main(argv: list[str]) -> int:
    runs = [r for r in tt.load_runs() if not argv or any(a in r["id"] for a in argv)]
    print(HEADER)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        print(row(run))
    # each group's rank correlation, then with a term of the step left out
    for name, members in tt.groups(tt.build_rows(runs)).items():
        if len(members) >= tt.MIN_GROUP:
            rho = tt.summary(members)["rho"][name]
            left = "; ".join(f"without {t}: {tt._rho(v)}"
                             for t, v in tt.term_rho(members).items())
            print(f"\n{name}: {tt._rho(rho)}; {left}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
