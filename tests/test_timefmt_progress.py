"""Times for people (ISO-8601 / relative) and the progress line with its ETA."""

from __future__ import annotations

import io

from ledger.cli.progress import Progress, eta, wanted
from ledger.domain.timefmt import duration, iso, relative, when

T = 1_700_000_000.0  # 2023-11-14T22:13:20Z


def test_iso_is_utc_with_z() -> None:
    assert iso(T) == "2023-11-14T22:13:20Z"
    assert iso(T + 0.9) == "2023-11-14T22:13:20Z"
    assert iso(None) == "-"


def test_a_time_no_date_can_show_is_written_as_a_number_not_an_error() -> None:
    # A stored time from a clock gone wrong (a retention cut-off of 9999999 days) must not
    # break the listing that shows it.
    assert iso(-315_537_897_600.0) == "-3.15538e+11 s since 1970"
    assert iso(1e300) == "1e+300 s since 1970"
    assert iso(float("nan")) == "nan s since 1970"
    assert when(-1e300, T).endswith("(-1e+300 s since 1970)")


def test_relative_in_the_future_and_the_past() -> None:
    assert relative(T + 4 * 60, T) == "in 4 m"
    assert relative(T - 12, T) == "12 s ago"
    assert relative(T + 0.2, T) == "now"
    assert relative(T - 3 * 3600, T) == "3 h ago"
    assert relative(T + 3 * 86400, T) == "in 3 d"
    assert relative(T + 2.5, T) == "in 2.5 s"
    assert when(T + 30, T) == "in 30 s (2023-11-14T22:13:50Z)"
    assert duration(119) == "119 s" and duration(120) == "2 m" and duration(7199) == "120 m"


def test_eta_from_the_average_rate() -> None:
    assert eta(0, 100, 5.0) is None  # no rate yet
    assert eta(25, 100, 10.0) == 30.0
    assert eta(100, 100, 10.0) == 0.0


def test_progress_draws_a_line_with_eta_and_ends_it() -> None:
    buf = io.StringIO()
    bar = Progress("generate", True, stream=buf)
    assert bar.line(40, 100, 12.0) == (
        "generate [############..................]  40%  40/100  12 s elapsed, ETA 18 s")
    bar(50, 100)
    bar(100, 100)
    text = buf.getvalue()
    assert text.count("\r") == 2 and text.endswith("done\x1b[K\n")


def test_progress_is_silent_when_disabled_and_off_a_terminal() -> None:
    buf = io.StringIO()
    bar = Progress("generate", False, stream=buf)
    bar(1, 2)
    bar(2, 2)
    bar.close()
    assert buf.getvalue() == ""
    assert not wanted(False, io.StringIO()) and wanted(True, io.StringIO())
