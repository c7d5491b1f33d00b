"""Progress: a bar redrawn in place on a terminal; whole lines, one per interval, anywhere else."""

import io

from tqdm import tqdm

from harvest.progress import PlainProgress, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_terminal_gets_a_bar_a_log_gets_lines_and_disabled_gets_nothing():
    tty, log = Terminal(), io.StringIO()
    with progress("export", " samples", total=3, stream=tty) as bar:
        assert isinstance(bar, tqdm)
        bar.update(3)
    assert "\r" in tty.getvalue() and "3/3" in tty.getvalue()
    with progress("export", " samples", total=3, stream=log) as bar:
        assert isinstance(bar, PlainProgress)
        bar.update(3)
    assert "\r" not in log.getvalue() and log.getvalue().count("\n") == 1
    assert log.getvalue().startswith("export: 3 samples of 3 (100%), ")
    quiet = io.StringIO()
    bar = progress("export", " samples", enabled=False, stream=quiet)
    bar.update(5)
    bar.close()
    assert quiet.getvalue() == ""


def test_plain_lines_come_once_per_interval_with_the_current_postfix_and_a_last_one_at_close():
    out, clock = io.StringIO(), Clock()
    bar = PlainProgress("produce", " rows", None, out, interval=30, clock=clock)
    bar.update(100)  # within the interval: nothing yet
    clock.t += 10
    bar.set_postfix(enqueued=90, bad=1)
    assert out.getvalue() == ""
    clock.t += 20
    bar.update(200)
    clock.t += 5
    bar.update(100)  # 5 s after a line: none
    bar.set_postfix_str("waiting: 7 queued")
    clock.t += 5
    bar.close()
    bar.close()  # once
    assert out.getvalue().splitlines() == [
        "produce: 300 rows, 10.0 rows/s, bad=1, enqueued=90",
        "produce: 400 rows, 10.0 rows/s, 40s in all, waiting: 7 queued",
    ]
    bar.update(1)
    assert len(out.getvalue().splitlines()) == 2  # nothing after close


def test_a_total_set_later_and_n_moved_directly_as_the_runner_does():
    out, clock = io.StringIO(), Clock()
    bar = PlainProgress("extract", " samples", None, out, interval=1, clock=clock)
    bar.total, bar.n = 40, 10
    clock.t += 2
    bar.set_postfix_str("queued 30 spooled 0 failed 0", refresh=False)
    bar.refresh()
    assert out.getvalue() == "extract: 10 samples of 40 (25%), 5.0 samples/s, queued 30 spooled 0 failed 0\n"
