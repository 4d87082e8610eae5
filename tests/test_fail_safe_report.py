"""``agentkv report`` fails safe (issue 37, findings 13 to 15): every malformed input ends in "FILE line N: why" and
exit 2, never a traceback; the input is streamed and bounded per line before it is parsed; 100k rows are drawn in one
pass under a fixed memory bound; an event log is grouped in one pass; ``--out`` is validated and the path printed is
the path written."""

import json
import os
import re
import subprocess
import sys
import threading
import tracemalloc
from dataclasses import asdict

import pytest

from agentkv.cli import main
from agentkv.report import write_ledger
from agentkv.stats import LedgerEntry

HEADER = {"agentkv_ledger": 1, "fast_window": 4096, "output_floor": 256, "warm_threshold": 0.6}
ROW = asdict(LedgerEntry(1, 1200, 100, 0.0833, "template", True, "fast", "fits_fast", "none", 0))


def row(**changes):
    return json.dumps({**ROW, **changes})


def rows(n):
    """``n`` ledger rows: a long conversation that warms once in every 3,000 turns and escalates."""
    for i in range(1, n + 1):
        phase = i % 3000
        yield LedgerEntry(i, 1000 + phase, 100, 0.05, "template", True, "fast" if phase < 2000 else "slow",
                          "fits_fast" if phase < 2000 else "over_fast_window", "fire" if phase == 1500 else "none",
                          500 if phase >= 2000 else 0)


def report(path, out, *extra):
    return main(["report", str(path), "--out", str(out), *extra])


def refusal(capsys):
    """The last line on stderr (the refusal); no traceback on either stream."""
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return captured.err.strip().splitlines()[-1]


# A ledger's second line, each malformed in its own way.
BAD_ROWS = {
    "deep JSON": "[" * 50_000,
    "NaN": row(input_tokens=float("nan")),
    "Infinity": row(tools_share=float("inf")),
    "a 500-digit number": row().replace('"input_tokens": 1200', '"input_tokens": 1' + "0" * 500),
    "a float past a float's range": row().replace('"tools_share": 0.0833', '"tools_share": 1e999'),
    "a string where a number belongs": row(input_tokens="1200"),
    "missing fields": json.dumps({"turn": 1}),
    "true as a turn": row(turn=True),
    "a number as a backend": row(backend=7),
    "a string as exact": row(exact="yes"),
    "an array as cached tokens": row(cached_tokens=[1]),
    "an object as a reason": row(reason={"a": 1}),
    "a negative token count": row(input_tokens=-5),
    "a count past 2**31": row(turn=2**40),
    "an array as a row": json.dumps([1, 2]),
}


@pytest.mark.parametrize("line", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_a_malformed_ledger_row_is_refused_naming_its_line(tmp_path, capsys, line):
    """Deep JSON, NaN, huge numbers, a string for a number, missing fields, a wrong type: "FILE line 2: why",
    exit 2, nothing drawn (today: RecursionError, ValueError, OverflowError, TypeError, or silently drawn)."""
    ledger = tmp_path / "turns.jsonl"
    ledger.write_text(json.dumps(HEADER) + "\n" + line + "\n")
    assert report(ledger, tmp_path / "life.png") == 2
    assert re.fullmatch(rf"agentkv report: {re.escape(str(ledger))} line 2: \S.*", refusal(capsys))
    assert not (tmp_path / "life.png").exists()


BAD_HEADERS = {
    "a string window": {**HEADER, "fast_window": "2048"},
    "NaN threshold": {**HEADER, "warm_threshold": float("nan")},
    "a threshold past 1": {**HEADER, "warm_threshold": 1e300},
    "an array floor": {**HEADER, "output_floor": [1]},
    "a huge window": {**HEADER, "fast_window": 10**500},
    "true as the format": {**HEADER, "agentkv_ledger": True},
}


@pytest.mark.parametrize("header", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_a_malformed_ledger_header_is_refused_naming_line_1(tmp_path, capsys, header):
    """The header's figures are checked like a row's: "FILE line 1: why", exit 2."""
    ledger = tmp_path / "turns.jsonl"
    ledger.write_text(json.dumps(header) + "\n" + row() + "\n")
    assert report(ledger, tmp_path / "life.png") == 2
    assert re.fullmatch(rf"agentkv report: {re.escape(str(ledger))} line 1: \S.*", refusal(capsys))


def event(name, **fields):
    return json.dumps({"event": name, "session": "s1", **fields})


BAD_EVENTS = {
    "NaN in a turn": event("turn_answered", **{**ROW, "input_tokens": float("nan")}),
    "a string in a turn": event("turn_answered", **{**ROW, "cached_tokens": "x"}),
    "a turn without its fields": event("turn_answered", turn=2),
    "a string window in a route": event("route", role="fast", window="big", floor=256),
    "a session that is an array": json.dumps({"event": "turn_answered", **ROW, "session": [1]}),
}


@pytest.mark.parametrize("line", BAD_EVENTS.values(), ids=BAD_EVENTS.keys())
def test_a_malformed_event_in_a_log_is_refused_naming_its_line(tmp_path, capsys, line):
    """In a JSON-lines event log, a turn_answered or fast route event that is malformed is refused by its line; other
    lines that are not JSON stay skipped (a log may mix renderers)."""
    log = tmp_path / "agentkv.log"
    log.write_text("a console line\n" + event("turn_answered", **ROW) + "\n" + line + "\n"
                   + '{"event": "other", "x": NaN}\n')
    assert report(log, tmp_path / "life.png") == 2
    assert re.fullmatch(rf"agentkv report: {re.escape(str(log))} line 3: \S.*", refusal(capsys))


def test_a_log_whose_other_lines_are_odd_is_still_drawn(tmp_path, capsys):
    """Lines of other events with NaN, deep nesting or no JSON at all are skipped, as before."""
    log = tmp_path / "agentkv.log"
    log.write_text("\n".join(['{"event": "other", "x": NaN}', "[" * 5000, "plain text", event("turn_answered", **ROW),
                              event("route", role="fast", window=4096, floor=256)]) + "\n")
    assert report(log, tmp_path / "life.png") == 0 and (tmp_path / "life.png").exists()
    capsys.readouterr()


def test_bad_utf8_and_an_empty_file_are_still_refused_clearly(tmp_path, capsys):
    """What held: bad UTF-8 is refused by its line, an empty file as empty."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps(HEADER).encode() + b"\n" + b'{"turn": "\xff\xfe"}\n')
    assert report(bad, tmp_path / "x.png") == 2
    assert refusal(capsys) == f"agentkv report: {bad} line 2: not UTF-8 text"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert report(empty, tmp_path / "x.png") == 2
    assert refusal(capsys) == f"agentkv report: {empty}: empty"


def test_a_nan_warm_threshold_is_refused_by_the_parser(tmp_path, capsys):
    """``--warm-threshold nan`` (or 0, or 2) is a usage error (exit 2), not a ValueError later."""
    log = tmp_path / "agentkv.log"
    log.write_text(event("turn_answered", **ROW) + "\n" + event("route", role="fast", window=4096, floor=256) + "\n")
    for value in ("nan", "0", "2", "inf"):
        with pytest.raises(SystemExit) as exited:
            report(log, tmp_path / "x.png", "--warm-threshold", value)
        assert exited.value.code == 2
        assert "warm-threshold" in capsys.readouterr().err


# Costs: structure, not time.

class Opens:
    """Counts the times a path is opened (an audit hook: it stays, so it only counts while armed)."""

    armed: list = []
    hooked = False

    @classmethod
    def of(cls, path):
        if not cls.hooked:
            sys.addaudithook(cls._hook)
            cls.hooked = True
        cls.armed[:] = [str(path), 0]
        return cls

    @classmethod
    def _hook(cls, name, args):
        if name == "open" and cls.armed and str(args[0]) == cls.armed[0]:
            cls.armed[1] += 1

    @classmethod
    def count(cls):
        count = cls.armed[1]
        cls.armed[:] = []
        return count


@pytest.fixture
def bounded_drawing(monkeypatch):
    """What the picture draws is bounded whatever the turns: a bounded number of bars, ticks and labels (today: one
    bar, one tick and one label a row, which is where 10k rows spent 142 s and 566 MB)."""
    from matplotlib.axes import Axes

    calls = {"annotate": 0}
    bar, annotate, set_xticks = Axes.bar, Axes.annotate, Axes.set_xticks

    def bounded_bar(self, x, *args, **kwargs):
        assert len(x) <= 1000, f"{len(x)} bars: one a row"
        return bar(self, x, *args, **kwargs)

    def bounded_annotate(self, *args, **kwargs):
        calls["annotate"] += 1
        assert calls["annotate"] <= 60, "one label a row"
        return annotate(self, *args, **kwargs)

    def bounded_ticks(self, ticks, *args, **kwargs):
        assert len(ticks) <= 200, f"{len(ticks)} ticks: one a row"
        return set_xticks(self, ticks, *args, **kwargs)

    monkeypatch.setattr(Axes, "bar", bounded_bar)
    monkeypatch.setattr(Axes, "annotate", bounded_annotate)
    monkeypatch.setattr(Axes, "set_xticks", bounded_ticks)
    return calls


def test_rows_are_read_once_and_drawn_under_a_memory_bound(tmp_path, capsys, bounded_drawing):
    """20,000 rows (the structure shows at this size; benchmarks/report_scale.py times 100,000): the file is opened
    once, the picture's artists are bounded, and the peak traced memory of the whole report (read, data, picture)
    stays under 8 MB plus 1 KB a row (today: a bar, a tick and a label a row; 4.1 GB at 100,000 rows)."""
    import matplotlib.pyplot  # noqa: F401  (its import is not the report's cost)

    n = 20_000
    ledger = write_ledger(tmp_path / "turns.jsonl", rows(n), fast_window=4096, output_floor=256, warm_threshold=0.6)
    opens = Opens.of(ledger)
    tracemalloc.start()
    try:
        assert report(ledger, tmp_path / "life.png") == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert opens.count() == 1
    assert peak < 8 * 2**20 + n * 1024, f"peak {peak / 2**20:.1f} MB"
    printed = capsys.readouterr().out
    assert printed.startswith(f"{n} turns") and len(printed) < 400 and str(tmp_path / "life.png") in printed


def test_rows_and_lines_past_the_bounds_are_refused_by_their_line(tmp_path, monkeypatch, capsys):
    """What held: past the rows a report draws (100,000; 100 here) and past 1,000,000 lines the file is refused, now
    naming the line."""
    import agentkv.report.ledger as ledger

    monkeypatch.setattr(ledger, "_MAX_ROWS", 100)
    more = write_ledger(tmp_path / "more.jsonl", rows(101), fast_window=4096, output_floor=256, warm_threshold=0.6)
    assert report(more, tmp_path / "x.png") == 2
    assert refusal(capsys).startswith(f"agentkv report: {more} line 102: ")
    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps(HEADER) + "\n" + "\n" * 1_000_000)
    assert report(lines, tmp_path / "x.png") == 2
    assert refusal(capsys).startswith(f"agentkv report: {lines} line 1000001: ")
    assert not (tmp_path / "x.png").exists()


def fill_fifo(path, chunk, total, written):
    """Write ``chunk`` to the FIFO at ``path`` until ``total`` bytes or its reader leaves; ``written`` gets the count."""
    with open(path, "wb", buffering=0) as fifo:
        try:
            while written[0] < total:
                written[0] += fifo.write(chunk)
        except BrokenPipeError:
            pass


def test_a_long_line_is_refused_before_it_is_read_whole(tmp_path, capsys):
    """A 32 MiB line (no newline: the shape of a 400 MB one-line file or /dev/zero): refused by line 1 after reading
    at most 1 MiB of it (today: read whole before its length is checked)."""
    fifo = tmp_path / "endless"
    os.mkfifo(fifo)
    written = [0]
    writer = threading.Thread(target=fill_fifo, args=(fifo, b"x" * 65536, 32 * 2**20, written), daemon=True)
    writer.start()
    try:
        assert report(fifo, tmp_path / "x.png") == 2
    finally:
        if writer.is_alive():  # unblock a writer still waiting on the pipe
            fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            os.close(fd)
        writer.join(10)
    assert written[0] <= 2**20, f"{written[0]} bytes read"
    assert refusal(capsys).startswith(f"agentkv report: {fifo} line 1: ")


def test_dev_zero_is_refused_quickly(tmp_path):
    """/dev/zero, under a 512 MiB address-space limit: refused by line 1 (today: read until MemoryError)."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20)); "
            "from agentkv.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "report", "/dev/zero", "--out", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("agentkv report: /dev/zero line 1: ")


class Touches:
    """Counting stand-ins for the builtins that walk a collection (len, sum, max, min, sorted): how many elements the
    module under test touches through them."""

    def __init__(self):
        self.count = 0

    def wrap(self, builtin, walks):
        def counted(*args, **kwargs):
            if walks and len(args) == 1:
                items = list(args[0])
                self.count += len(items)
                return builtin(items, **kwargs)
            self.count += 1
            return builtin(*args, **kwargs)
        return counted


def test_an_event_log_is_grouped_by_session_in_one_pass(tmp_path, monkeypatch, capsys):
    """2,000 sessions of one turn each: the file is opened once, and the elements the reader walks grow with the
    lines, not with lines times sessions (today: every line sums the turns of every session seen, 2M here)."""
    import builtins

    import agentkv.report.ledger as ledger

    touches = Touches()
    for name, walks in (("len", False), ("sum", True), ("max", True), ("min", True), ("sorted", True)):
        monkeypatch.setattr(ledger, name, touches.wrap(getattr(builtins, name), walks), raising=False)
    log = tmp_path / "agentkv.log"
    sessions = 2000
    with log.open("w") as out:
        for n in range(sessions):
            out.write(json.dumps({"event": "route", "session": f"s{n}", "role": "fast", "window": 4096,
                                  "floor": 256}) + "\n")
            out.write(json.dumps({"event": "turn_answered", "session": f"s{n}", **ROW}) + "\n")
    opens = Opens.of(log)
    header, read = ledger.read_ledger(log, session="s7")
    assert touches.count <= 10 * 2 * sessions, f"{touches.count} elements walked for {2 * sessions} lines"
    assert opens.count() == 1
    assert header["session"] == "s7" and len(read) == 1


# --out

@pytest.fixture
def small(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ledger = tmp_path / "turns.jsonl"
    ledger.write_text(json.dumps(HEADER) + "\n" + row() + "\n")
    return ledger


@pytest.mark.parametrize("out", ["x.exe", "afile/x.png", "afile/deeper/x.png", "-", ""])
def test_an_out_path_that_cannot_be_a_picture_is_refused(small, tmp_path, capsys, out):
    """An unsupported extension, a parent that is a file, "-" and "": exit 2 and a message naming --out, nothing
    written (today: tracebacks, or "-.png" and "./.png" written while another path is printed)."""
    (tmp_path / "afile").write_text("a file, not a folder")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert report(small, out) == 2
    assert "--out" in refusal(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(("out", "written"), [("adir", "adir/agentkv-report.png"), ("life", "life.png"),
                                              ("sub/life.svg", "sub/life.svg")])
def test_the_message_prints_the_path_written(small, tmp_path, capsys, out, written):
    """An existing folder gets agentkv-report.png inside it, a name without an extension gets .png: the message
    prints the path that was written (today: "adir.png" written, "adir" printed)."""
    (tmp_path / "adir").mkdir()
    assert report(small, out) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.endswith(f": {written}")
    assert (tmp_path / written).is_file()
    assert not (tmp_path / "adir.png").exists()
