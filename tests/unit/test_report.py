"""The report layer: the one place bytes become GiB, and what it prints for each command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import memplan
from memplan.report.sizes import bytes_and_gib, format_gib, gib, in_gib, size

PACKAGE = Path(memplan.__file__).parent
REPORT = PACKAGE / "report"
# a byte count divided by GiB, or handed to the labelled formatter
CONVERSION = re.compile(r"/\s*GiB\b|format_gib\(")


def test_bytes_become_gib_only_in_the_report_layer() -> None:
    """No module outside memplan/report/ divides by GiB or formats GiB itself: tables, plots,
    sentences and error messages all call memplan.report.sizes."""
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if REPORT in path.parents:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if CONVERSION.search(line):
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert outside == []


def test_the_grep_sees_a_conversion() -> None:
    """The pattern the test above looks for matches the ways a conversion is written."""
    for line in ('f"{x / GiB:.2f}"', "peak_bytes/GiB", 'f"{format_gib(n)} free"'):
        assert CONVERSION.search(line), line
    for line in ("from memplan.units import GiB", "80GiB", '"GiB = 2^30 B"'):
        assert not CONVERSION.search(line), line


@pytest.mark.parametrize(("num_bytes", "gib_text", "labelled", "sized"), [
    (0, "0.00", "0.00 GiB", "0.00 MiB"),
    (2**30, "1.00", "1.00 GiB", "1.00 GiB"),
    (13_421_772_800, "12.50", "12.50 GiB", "12.50 GiB"),  # 12.5 * 2^30
    (886_054_052, "0.83", "0.83 GiB", "845.01 MiB"),  # 845.01 MiB, as PyTorch prints it
    (-3 * 2**29, "-1.50", "-1.50 GiB", "-1.50 GiB"),  # a negative headroom
])
def test_sizes(num_bytes: int, gib_text: str, labelled: str, sized: str) -> None:
    assert gib(num_bytes) == gib_text
    assert format_gib(num_bytes) == labelled
    assert size(num_bytes) == sized
    assert in_gib(num_bytes) == num_bytes / 2**30


def test_digits_and_exact_bytes() -> None:
    assert gib(85_899_345_920, 1) == "80.0"  # 80 * 2^30
    assert format_gib(1_610_612_736, 3) == "1.500 GiB"
    assert bytes_and_gib(419_430_400) == "419,430,400 B (0.391 GiB)"  # 400 MiB


def test_check_error_names_the_sizes_in_gib() -> None:
    """Llama-2-7B on one 80 GB H100 at seq 512: 16 bytes per parameter of states alone
    (6,738,415,616 x 16 = 107.8 GB) exceed the 79.19 GiB the device reports."""
    est = memplan.estimate("llama-2-7b", gpus=1, seq_len=512)
    with pytest.raises(memplan.MemplanError) as err:
        memplan.check("llama-2-7b", gpus=1, seq_len=512)
    w = est.worst
    assert str(err.value) == (
        f"does not fit: stage 0 peaks at {format_gib(w.peak_bytes)} ({w.peak_phase}) > "
        f"{format_gib(int(est.capacity_bytes * 0.95))} usable (79.19 GiB, 5% kept free); "
        f"params 12.55 GiB, grads 12.55 GiB, optimizer {format_gib(w.optimizer_bytes)}, "
        f"activations {format_gib(w.activations_bytes)}")
    assert w.params_bytes == 6_738_415_616 * 2  # bf16 weights: 12.55 GiB


def test_monitor_table_in_gib() -> None:
    """A rank's peak of 3 * 2^30 + 2^29 bytes reads 3.50 in the GiB column."""
    from rich.console import Console

    from memplan.report.monitor import render_monitor_summary

    result = {"worst_rank": 1, "ranks": {
        1: {"num_steps": 4, "max_peak_bytes": 3 * 2**30 + 2**29, "max_reserved_bytes": 4 * 2**30,
            "median_step_time_s": 0.25, "num_warnings": 0},
    }}
    console = Console(width=200, record=True)
    console.print(render_monitor_summary(result))
    row = next(line for line in console.export_text().splitlines() if "1 *" in line)
    assert [cell.strip() for cell in row.split("│")[1:-1]] == [
        "1 *", "4", "3.50", "4.00", "", "", "", "", "0.2500", "0"]
