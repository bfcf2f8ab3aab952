"""``memplan calibrate --nproc N``'s one-line error when torchrun fails: the line that says why
a rank failed, not the frame of torchrun's own report (its last line is ``=====``)."""

from __future__ import annotations

from memplan.cli.calibrate import failure_line

# torchrun's report after a rank aborted at exit (a 2-rank gloo run on CPU, torch 2.13): the
# abort message, torchrun's own traceback, then the table.
ABORTED = """\
terminate called without an active exception
Traceback (most recent call last):
File "<frozen runpy>", line 198, in _run_module_as_main
raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
memplan.profile.calibrate_dist FAILED
------------------------------------------------------
Failures:
[1]:
exitcode  : -15 (pid: 8335)  (SIGTERM)
traceback : Signal 15 (SIGTERM) received by PID 8335
------------------------------------------------------
Root Cause (first observed failure):
[0]:
rank      : 1 (local_rank: 1)
exitcode  : -6 (pid: 8336)  (SIGABRT)
traceback : Signal 6 (SIGABRT) received by PID 8336
======================================================"""


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def test_an_abort_names_the_abort() -> None:
    assert failure_line(_lines(ABORTED)) == "terminate called without an active exception"


def test_a_raised_exception_wins_over_torchruns_own() -> None:
    text = ("[rank1]: Traceback (most recent call last):\n"
            "[rank1]:   File \"x.py\", line 3, in f\n"
            "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:29500\n" + ABORTED)
    assert failure_line(_lines(text)) == ("[rank1]: RuntimeError: Connection closed by peer "
                                          "[127.0.0.1]:29500")


def test_without_a_message_the_root_causes_signal() -> None:
    text = ABORTED.replace("terminate called without an active exception\n", "")
    assert failure_line(_lines(text)) == "Signal 6 (SIGABRT) received by PID 8336"


def test_otherwise_the_last_line_that_is_not_a_frame() -> None:
    assert failure_line(["bad option --x", "=====", "-----"]) == "bad option --x"
    assert failure_line(["====="]) == "no output"
    assert failure_line([]) == "no output"
