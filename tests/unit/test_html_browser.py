"""The ``--html`` page opened in a real headless Chromium: it renders without a script error,
the numbers it shows are the JSON's, and it makes no network request.

Each page is loaded from a file:// URL with every host name resolving to nothing
(``--host-resolver-rules``) and Chromium's network log on. A request the page made would be in
that log with the page's (opaque, file://) origin as its initiator; the browser's own
background requests (its updater, its account check) carry no origin and are not the page's.
The page itself records each request its Content-Security-Policy refused and each script error
in its DOM (``data-errors``, ``#errors``), and how many resources it loaded
(``data-resources``). Two pages with an image link planted in them show that both checks
catch a request.

Expected numbers are the JSON's bytes in GiB (2^30) or MiB (2^20) with two decimals, written
here with Python's format; each stage's bar is checked against
``memplan.report.plot_estimate.stage_parts``, the split the PNG plot draws.

Skipped where no Chromium is installed (``apt-get install chromium``; MEMPLAN_CHROMIUM names
another binary).
"""

from __future__ import annotations

import html
import json
import os
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import memplan
from memplan.cli import main
from memplan.report import estimate_json
from memplan.report.html import page
from memplan.report.plot_estimate import stage_parts
from memplan.report.versioned import versioned


def _find_chromium() -> str | None:
    named = os.environ.get("MEMPLAN_CHROMIUM")
    if named:
        return shutil.which(named)
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    return None


CHROMIUM = _find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium binary on PATH (chromium, chromium-browser, "
    "google-chrome; or MEMPLAN_CHROMIUM): the HTML report is not opened in a browser here")

GIB, MIB = 2**30, 2**20


def gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def size(num_bytes: int) -> str:
    return gib(num_bytes) if abs(num_bytes) >= GIB else f"{num_bytes / MIB:.2f} MiB"


class Node:
    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag, self.attrs, self.kids = tag, attrs, []

    def text(self) -> str:
        return "".join(k if isinstance(k, str) else k.text() for k in self.kids)

    def all(self, tag: str | None = None, **attrs: str) -> list[Node]:
        found = []
        for kid in self.kids:
            if isinstance(kid, Node):
                names = {k.rstrip("_").replace("_", "-"): v for k, v in attrs.items()}
                if (tag is None or kid.tag == tag) and all(
                        kid.attrs.get(k) == v for k, v in names.items()):
                    found.append(kid)
                found += kid.all(tag, **attrs)
        return found

    def one(self, tag: str | None = None, **attrs: str) -> Node:
        found = self.all(tag, **attrs)
        assert len(found) == 1, (tag, attrs, len(found))
        return found[0]


class _Tree(HTMLParser):
    VOID = {"meta", "br", "img", "input", "link", "hr", "area", "base", "col", "embed",
            "source", "track", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].kids.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].kids.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].kids.append(data)


def _chromium(target: Path, work: Path, *action: str) -> tuple[str, list[str]]:
    """Open ``target`` in headless Chromium doing ``action`` (--dump-dom, --screenshot=...):
    its stdout, and the URLs of the requests the page made (the network log's requests that
    carry an origin as initiator). ``--virtual-time-budget``: the page's queued tasks (the
    policy's violation event among them) run before the DOM is dumped, whatever the load."""
    net = work / "net.json"
    run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={work / 'profile'}", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-default-apps",
         "--host-resolver-rules=MAP * ~NOTFOUND", f"--log-net-log={net}",
         "--hide-scrollbars", "--virtual-time-budget=10000", *action,
         target.resolve().as_uri()],
        capture_output=True, text=True, timeout=180, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    log = json.loads(net.read_text())
    kinds = {code: name for name, code in log["constants"]["logEventTypes"].items()}
    requests = [e["params"]["url"] for e in log["events"]
                if kinds.get(e["type"]) == "URL_REQUEST_START_JOB"
                and e.get("params", {}).get("initiator", "not an origin") != "not an origin"]
    return run.stdout, requests


def _open(target: Path, work: Path) -> Node:
    """The rendered DOM of ``target``, checked: drawn, no script error or refused request, no
    resource loaded, no request in the network log."""
    work.mkdir(exist_ok=True)
    dom, requests = _chromium(target, work, "--dump-dom")
    assert requests == []
    tree = _Tree()
    tree.feed(dom)
    body = tree.root.one("body")
    errors = tree.root.one(id="errors")
    assert body.attrs.get("data-rendered") == "ok", errors.text()
    assert "data-errors" not in body.attrs and "hidden" in errors.attrs, errors.text()
    assert body.attrs.get("data-resources") == "0"
    return tree.root


def _estimate_page(tmp_path: Path, **kwargs: Any) -> tuple[Any, dict[str, Any], Node]:
    est = memplan.estimate(**kwargs)
    data = json.loads(json.dumps(versioned("estimate", estimate_json(est))))
    tmp_path.mkdir(exist_ok=True)
    target = tmp_path / "estimate.html"
    target.write_text(page(data), encoding="utf-8")
    return est, data, _open(target, tmp_path / "browser")


_REST = "rest of the tensor peak (activations, temporaries, ...)"


@pytest.mark.parametrize("config", [
    # four stages peaking in the steady optimizer step (foreach temporaries)
    dict(model="llama-7b", gpus=8, tp=2, pp=4),
    # torchtitan keeps gradients (zero_grad(set_to_none=False)): a steady backward peak
    # holds them
    dict(model="llama-3-8b", gpus=8, framework="torchtitan", zero=3, micro_batch_size=2),
    # accumulation over 4 micro-batches: gradients held through forward and backward
    dict(model="llama-7b", gpus=8, zero=1, micro_batch_size=1, global_batch_size=32),
], ids=["pp4-optimizer-peak", "torchtitan-keep-grads", "accumulation"])
def test_the_estimate_page_shows_the_json_numbers(config: dict[str, Any],
                                                  tmp_path: Path) -> None:
    """Each stage's peak as the table shows it, each bar's parts (summing to the stage's
    peak, split as ``stage_parts``), the six phase peaks per stage, the verdict's peak, and
    every assumption's text."""
    est, data, dom = _estimate_page(tmp_path, **config)
    for s, stage in zip(est.stages, data["stages"], strict=True):
        shown = dom.one("strong", class_="stage-peak", data_stage=str(stage["stage"]))
        assert shown.text() == gib(stage["peak_bytes"])
        bar = dom.one(id="stage-bars").one("g", data_row=str(data["stages"].index(stage)))
        parts = {r.attrs["data-part"]: int(r.attrs["data-bytes"]) for r in bar.all("rect")}
        want = {k: v for k, v in stage_parts(est, s).items() if v > 0}
        rest = want.pop(_REST, 0)
        if rest:
            name = ("optimizer-step temporaries" if stage["peak_phase"].startswith("optimizer")
                    else "activations and temporaries")
            want[name] = rest
        assert parts == want
        assert sum(parts.values()) == stage["peak_bytes"]
        label = bar.all("text")[-1]
        assert label.text().startswith(gib(stage["peak_bytes"]))
        row = next(r for r in dom.one(id="phase-table").all("tr")
                   if r.all("td") and r.all("td")[0].text() == f"stage {stage['stage']}")
        assert [td.text() for td in row.all("td")[1:]] == [
            gib(stage["phases"][when][f"{phase}_bytes"])
            for when in ("first_step", "steady") for phase in ("forward", "backward", "optimizer")]
    assert dom.one(id="peak").text().startswith(gib(data["peak_bytes"]))
    page_text = dom.one(id="assumptions").text()
    for assumption in data["assumptions"]:
        assert assumption.split(": ", 1)[-1] in page_text


def test_keep_grads_is_what_makes_the_steady_split_hold_gradients(tmp_path: Path) -> None:
    """The torchtitan page's steady backward bar has a gradients part (kept between steps);
    the same job with gradients freed (``keep_grads=False``) has none, its bytes being in the
    rest of the tensor peak."""
    kw = dict(model="llama-3-8b", gpus=8, framework="torchtitan", zero=3, micro_batch_size=2)
    _, kept, dom = _estimate_page(tmp_path / "kept", **kw)
    assert kept["workload"]["keep_grads"] is True
    assert kept["stages"][0]["peak_phase"] == "backward (steady)"
    assert dom.one(id="stage-bars").all("rect", data_part="gradients")
    _, freed, dom = _estimate_page(tmp_path / "freed", keep_grads=False, **kw)
    assert freed["stages"][0]["peak_phase"].split()[0] in ("forward", "backward")
    assert not dom.one(id="stage-bars").all("rect", data_part="gradients")


def _cli_page(argv: list[str], tmp_path: Path,
              capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], Node]:
    target = tmp_path / "report.html"
    assert main([*argv, "--json", "--html", str(target)]) == 0
    data = json.loads(capsys.readouterr().out)
    return data, _open(target, tmp_path / "browser")


def test_the_plan_page_shows_each_candidates_peak(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    data, dom = _cli_page(["plan", "-m", "llama-7b", "-n", "8", "--top", "3"], tmp_path, capsys)
    shown = [n.text() for n in dom.all("strong", class_="candidate-peak")]
    assert shown == [gib(c["peak_bytes"]) for c in data["candidates"]] and len(shown) == 3
    bars = dom.one(id="candidate-bars").all("rect")
    assert [int(r.attrs["data-bytes"]) for r in bars] == [c["peak_bytes"]
                                                          for c in data["candidates"]]


def test_the_diagnose_page_shows_findings_fixes_and_the_estimate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Llama-2-7B at micro-batch 4 on 8 H100 with ZeRO 1 does not fit: each finding's
    message, each fix's peak, the failing phase's components and the estimate's stage peak."""
    data, dom = _cli_page(["diagnose", "-m", "llama-2-7b", "-n", "8", "--zero", "1", "--mbs",
                           "4"], tmp_path, capsys)
    findings = dom.one(id="findings").text()
    for finding in data["findings"]:
        assert finding["message"] in findings
    rows = [tr.all("td") for tr in dom.one(id="fix-table").all("tr") if tr.all("td")]
    assert [r[3].text() for r in rows] == [gib(f["peak_bytes"]) for f in data["fixes"]]
    parts = {r.attrs["data-part"]: int(r.attrs["data-bytes"])
             for r in dom.one(id="component-bars").all("rect")}
    phase = next(f["sizes"]["phase_bytes"] for f in data["findings"] if f["kind"] == "dominant")
    assert parts.pop("other tensors") == phase - sum(data["components_bytes"].values())
    assert parts == {k: v for k, v in data["components_bytes"].items() if v > 0}
    shown = dom.one("strong", class_="stage-peak", data_stage="0").text()
    assert shown == gib(data["estimate"]["stages"][0]["peak_bytes"])


def test_the_profile_page_shows_predicted_beside_measured(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny model's profile (CPU tracker, fake tensors): each step and phase's measured
    and predicted peaks, in MiB as the JSON's bytes give them, and the bars of both."""
    pytest.importorskip("torch")
    data, dom = _cli_page(["profile", "-m", "tiny", "--steps", "2"], tmp_path, capsys)
    rows = [tr.all("td") for tr in dom.one(id="mvp-table").all("tr") if tr.all("td")]
    want = data["measured_vs_predicted"]
    assert len(rows) == len(want) == 6
    for cells, row in zip(rows, want, strict=True):
        assert (cells[1].text(), cells[2].text(), cells[3].text()) == (
            row["phase"], size(row["measured_bytes"]), size(row["predicted_bytes"]))
    bars = [int(r.attrs["data-bytes"]) for r in dom.one(id="mvp-chart").all("rect")]
    assert bars == [b for row in want for b in (row["measured_bytes"], row["predicted_bytes"])]


def _planted(tmp_path: Path, keep_policy: bool) -> Path:
    """An estimate page with an image from a host planted in it, its policy kept or not."""
    data = json.loads(json.dumps(versioned("estimate", estimate_json(
        memplan.estimate("tiny")))))
    text = page(data).replace('<main id="report">',
                              '<img src="http://memplan-test.invalid/x.png" alt="">'
                              '<main id="report">')
    if not keep_policy:
        start = text.index('<meta http-equiv="Content-Security-Policy"')
        text = text[:start] + text[text.index(">", start) + 1:]
    target = tmp_path / "planted.html"
    target.write_text(text, encoding="utf-8")
    return target


def test_a_planted_request_is_refused_and_reported_by_the_page(tmp_path: Path) -> None:
    """With the page's policy the browser refuses the planted image and the page says so."""
    dom, requests = _chromium(_planted(tmp_path, True), tmp_path, "--dump-dom")
    tree = _Tree()
    tree.feed(dom)
    assert requests == []
    assert tree.root.one("body").attrs.get("data-errors") == "1"
    assert "blocked request: http://memplan-test.invalid/x.png" in html.unescape(
        tree.root.one(id="errors").text())


def test_the_network_log_sees_a_request_when_nothing_refuses_it(tmp_path: Path) -> None:
    """Without the policy the planted image is requested, and the network log check (the one
    every page above passes) finds it: the check can fail."""
    _, requests = _chromium(_planted(tmp_path, False), tmp_path, "--dump-dom")
    assert requests == ["http://memplan-test.invalid/x.png"]


def test_the_page_renders_to_a_screenshot(tmp_path: Path) -> None:
    """A 1280 x 2000 screenshot of a four-stage estimate is written, that size, and is not
    blank (a blank page compresses to a few kB; this one's bars, text and tables do not)."""
    est = memplan.estimate("llama-7b", gpus=8, tp=2, pp=4)
    target = tmp_path / "estimate.html"
    target.write_text(page(json.loads(json.dumps(versioned("estimate", estimate_json(est))))),
                      encoding="utf-8")
    shot = tmp_path / "estimate.png"
    _, requests = _chromium(target, tmp_path, f"--screenshot={shot}", "--window-size=1280,2000")
    assert requests == []
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (1280, 2000)
    assert len(png) > 60_000, len(png)


def test_sizes_round_as_python_prints_them(tmp_path: Path) -> None:
    """A size exactly halfway between two hundredths rounds to the even one, as Python's
    ``f"{x:.2f}"`` does (JavaScript's ``toFixed`` would round it up): 1.125 GiB =
    1,207,959,552 B shows as 1.12 GiB, 1.375 GiB = 1,476,395,008 B as 1.38 GiB, and
    -0.625 GiB of headroom as -0.62 GiB."""
    data = json.loads(json.dumps(versioned("estimate", estimate_json(memplan.estimate("tiny")))))
    data["stages"][0]["params_bytes"] = 1_207_959_552
    data["stages"][0]["grads_bytes"] = 1_476_395_008
    data["headroom_bytes"] = -671_088_640
    assert (gib(1_207_959_552), gib(1_476_395_008), gib(-671_088_640)) == (
        "1.12 GiB", "1.38 GiB", "-0.62 GiB")
    target = tmp_path / "ties.html"
    target.write_text(page(data), encoding="utf-8")
    dom = _open(target, tmp_path / "browser")
    row = [r for r in dom.one(id="stage-table").all("tr") if r.all("td")][0].all("td")
    assert (row[2].text(), row[3].text()) == ("1.12 GiB", "1.38 GiB")
    assert "-0.62 GiB" in dom.one(id="summary").text()
