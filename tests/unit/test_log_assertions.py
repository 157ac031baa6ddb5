"""Tests say what the system decided, not what it printed (issue 31, part 7; the rule: tests/log_interface.py).

Every test module under tests/ is parsed with ``ast`` and its log-text assertions counted. A marked one (``#
log-interface: <why>`` at the assertion, or a call of ``assert_refusal``) is a refusal or one-line error whose
words are the interface; at most ``LIMIT`` are marked. An unmarked one is allowed only while its file is in
``UNMARKED``, the debt still to pay, which may only shrink: a file's count must match it exactly, so a fixed
assertion is struck from the list in the same commit and a new one fails here.
"""
from __future__ import annotations

import textwrap
from collections import Counter

from deadpool_ext.testing.launch import REPO
from tests.log_interface import LIMIT, all_sites, sites_in

UNMARKED: dict[str, int] = {
}
"""Unmarked log-text assertions per file still to replace by a decision (issue 31, part 7). Only shrinks."""


def test_at_most_twenty_log_text_assertions_are_marked_as_the_interface():
    marked = [f"{s.path}:{s.line}: {s.source}" for s in all_sites(REPO) if s.marked]
    assert len(marked) <= LIMIT, "\n".join(marked)


def test_no_log_text_assertion_is_unmarked_beyond_the_recorded_debt():
    sites = [s for s in all_sites(REPO) if not s.marked]
    per_file = Counter(s.path for s in sites)
    grew = {p: n for p, n in per_file.items() if n > UNMARKED.get(p, 0)}
    assert not grew, "assert on a decision (timeline event, typed stats, exit code, return value) instead:\n" + \
        "\n".join(f"{s.path}:{s.line}: {s.source}" for s in sites if s.path in grew)
    paid = {p: (n, per_file.get(p, 0)) for p, n in UNMARKED.items() if per_file.get(p, 0) < n}
    assert not paid, f"lower UNMARKED to the new counts (recorded, now): {paid}"


def _count(src: str) -> list[tuple[int, bool]]:
    return [(s.line, s.marked) for s in sites_in("t.py", textwrap.dedent(src))]


def test_the_counter_finds_output_logs_and_names_bound_from_them():
    assert _count("""
        def test_a(caplog, capsys, tmp_path):
            res = run()
            assert "x" in res.output
            assert res.returncode == 0
            err = capsys.readouterr().err
            lines = err.strip().splitlines()
            assert lines[0].startswith("deadpool-run:")
            assert any("y" in r.message for r in caplog.records)
            assert res.stderr.count("z") == 2
            assert re.search("w+", res.stdout)
            assert "t" in (tmp_path / "run.log").read_text()
            cap = capsys.readouterr()
            assert cap.out == ""
        """) == [(4, False), (8, False), (9, False), (10, False), (11, False), (12, False), (14, False)]


def test_parsed_output_exception_messages_and_returned_strings_are_not_log_text():
    assert _count("""
        def test_b(tmp_path):
            res = run()
            data = json.loads(res.stdout)
            assert "x" in data and data["k"] == "v"
            with pytest.raises(ValueError) as err:
                f()
            assert "bad" in str(err.value)
            assert "out of spares" in stop_line("x")
            assert "a" in (tmp_path / "outside").read_text()
            assert "b" in res.output[-100:] or True, res.output  # the failure message is not the test
        """) == [(11, False)]


def test_marks_helper_calls_and_functions_returning_output():
    assert _count("""
        @pytest.fixture
        def job(tmp_path):
            def run(*argv):
                return subprocess.run(argv, capture_output=True, text=True).stderr.strip()
            return run

        def test_c(job, r):
            assert job("--x").startswith("deadpool-run: --x")  # log-interface: the refusal names the flag
            assert_refusal(r, rc=2, names="--x")
            assert_refusal(
                r, rc=2, names="--y")
        """) == [(9, True), (10, True), (11, True)]


def test_helpers_that_check_log_text_and_captured_buffers_count():
    assert _count("""
        def test_d(caplog):
            def said(key):
                return key in caplog.text

            buf = io.StringIO()
            assert "x" in buf.getvalue()
            assert said("k")
            assert len(buf.getvalue().splitlines()) == 1
        """) == [(7, False), (8, False)]


def test_a_helper_that_asserts_on_output_counts_once_per_call():
    assert _count("""
        def one_line(res, needle):
            assert needle in res.stderr

        def test_e(res):
            one_line(res, "a")
            one_line(res, "b")  # log-interface: names the file
        """) == [(6, False), (7, True)]


def test_lines_read_from_a_stream_and_collected_in_a_list_count():
    assert _count("""
        def test_f(proc):
            lines = []
            line = proc.stderr.readline()
            lines.append(line)
            text = "".join(lines)
            assert "x" in text
            assert json.loads(proc.stdout.readline())["open"] > 0
        """) == [(7, False)]
