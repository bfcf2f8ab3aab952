"""``--html PATH`` (estimate, plan, diagnose, profile): one self-contained page that carries the
command's ``--json`` object and draws from it; its path checked before any work.

What a browser makes of the page (the numbers it shows, no request) is
``tests/unit/test_html_browser.py``'s."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from memplan.cli import main
from memplan.errors import MemplanError
from memplan.report.html import check_path, embedded_json, page

ESTIMATE = ["estimate", "-m", "llama-7b", "-n", "8", "--tp", "2", "--pp", "4"]
PLAN = ["plan", "-m", "llama-7b", "-n", "8", "--top", "3"]
DIAGNOSE = ["diagnose", "-m", "llama-2-7b", "-n", "8", "--zero", "1", "--mbs", "4", "--no-fixes"]
PROFILE = ["profile", "-m", "tiny", "--steps", "2"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _self_contained(text: str) -> None:
    """Nothing the browser would fetch: no URL at all, no stylesheet or script file, no CSS
    import or url(), no frame, image or object; and a policy that forbids any request."""
    assert "http://" not in text and "https://" not in text
    lowered = text.lower()
    assert "<link" not in lowered and "@import" not in lowered and "url(" not in lowered
    assert re.search(r"<script[^>]*\ssrc\s*=", lowered) is None
    for tag in ("<img", "<iframe", "<object", "<embed", "<audio", "<video", "<base"):
        assert tag not in lowered, tag
    assert "Content-Security-Policy" in text and "default-src 'none'" in text


@pytest.mark.parametrize("argv", [ESTIMATE, PLAN, DIAGNOSE, PROFILE],
                         ids=["estimate", "plan", "diagnose", "profile"])
def test_the_page_carries_the_json_the_command_prints(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With ``--json --html``: the page is written, self-contained, and the object in its
    data block is the one printed, ``html`` (the page's own path) included."""
    target = tmp_path / "report.html"
    code, out, _ = _run([*argv, "--json", "--html", str(target)], capsys)
    assert code == 0
    printed = json.loads(out)
    text = target.read_text(encoding="utf-8")
    assert embedded_json(text) == printed
    assert printed["html"] == str(target) and printed["command"] == argv[0]
    _self_contained(text)
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left


def test_without_json_the_page_still_carries_what_json_prints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The text run writes the same page as the JSON run (the object --json prints, with the
    same ``html`` path), says where, and keeps its text report in the page."""
    target = tmp_path / "report.html"
    code, text_out, _ = _run([*ESTIMATE, "--html", str(target)], capsys)
    assert code == 0 and text_out.rstrip().endswith(f"wrote {target}")
    from_text_run = target.read_text(encoding="utf-8")
    code, json_out, _ = _run([*ESTIMATE, "--html", str(target), "--json"], capsys)
    assert code == 0
    assert embedded_json(from_text_run) == json.loads(json_out)
    assert "most loaded" in from_text_run and "<details id=\"fallback\"" in from_text_run


def test_the_estimate_json_names_kept_gradients(capsys: pytest.CaptureFixture[str]) -> None:
    """``workload.keep_grads`` (which the page needs to split a steady peak like
    ``plot_estimate.stage_parts``): off by default, on with ``--keep-grads``."""
    for flag, want in (("--no-keep-grads", False), ("--keep-grads", True)):
        code, out, _ = _run(["estimate", "-m", "tiny", flag, "--json"], capsys)
        assert code == 0 and json.loads(out)["workload"]["keep_grads"] is want


def test_a_string_cannot_close_the_data_block() -> None:
    """Text from the user's files (a model name, a config value) goes into the page as JSON
    with ``<``, ``>`` and ``&`` escaped: ``</script>`` in a value neither ends the block nor
    changes the object read back."""
    data = {"schema_version": 1, "command": "estimate",
            "model": "</script><script>alert(1)</script> & <!--"}
    text = page(data)
    assert text.count("</script>") == 2  # the data block's and the script's own
    assert embedded_json(text) == data
    assert "<title>memplan estimate: &lt;/script&gt;" in text


def _bad_paths(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "a_file.txt").write_text("x")
    (tmp / "folder.html").mkdir()
    os.symlink(tmp / "nowhere", tmp / "dangling")
    return {
        "not .html": (tmp / "report.png", "must end in .html"),
        "under a file": (tmp / "a_file.txt" / "report.html", "not a folder"),
        "a folder": (tmp / "folder.html", "is a folder"),
        "through a dangling link": (tmp / "dangling" / "report.html",
                                    "symbolic link to nothing"),
        "name too long": (tmp / ("x" * 300 + ".html"), "too long"),
    }


@pytest.mark.parametrize("case", ["not .html", "under a file", "a folder",
                                  "through a dangling link", "name too long"])
@pytest.mark.parametrize("argv", [ESTIMATE, PLAN, DIAGNOSE, PROFILE],
                         ids=["estimate", "plan", "diagnose", "profile"])
def test_a_bad_html_path_is_one_line_exit_2_before_any_work(
        case: str, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A path the page cannot be written to is refused in one line naming ``--html``, exit 2,
    before anything is estimated (the estimate and the planner would raise if reached), and
    nothing is written."""
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)

    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command did work before checking --html")

    import memplan.api
    import memplan.cli.estimate
    import memplan.cli.profile

    monkeypatch.setattr(memplan.cli.estimate, "run_estimate", reached)
    monkeypatch.setattr(memplan.api, "plan", reached)
    monkeypatch.setattr(memplan.cli.profile, "resolve", reached)
    monkeypatch.setattr("memplan.diagnose.diagnose", reached)
    path, words = _bad_paths(tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = _run([*argv, "--html", str(path)], capsys)
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("memplan: error: --html") and err.count("\n") == 1, err
    assert words in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any folder: no permission to "
                    "refuse")
def test_an_unwritable_folder_is_refused(tmp_path: Path) -> None:
    """A folder this user may not write in: one line naming ``--html``."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(MemplanError, match="--html: cannot write in"):
            check_path(locked / "report.html")
    finally:
        locked.chmod(0o700)


def test_a_failed_write_leaves_the_old_page(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The page goes to a temporary file beside the target and is renamed over it: a write
    that fails (here the rename) leaves the earlier page as it was and no temporary file."""
    from memplan.report.html import write_html

    target = tmp_path / "report.html"
    target.write_text("earlier page")

    def no_rename(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(MemplanError, match="No space left on device"):
        write_html(target, {"schema_version": 1, "command": "estimate"})
    assert target.read_text() == "earlier page"
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
