"""The README's benchmark headlines cannot go stale unseen: the README's block, REPORT.md's section and every doc's
quote are what the current results render (each figure with its commit and date, marked stale when the code it
measured is not the checkout's), no doc types a headline figure by hand, and no headline result was measured under a
default of the "deadpool" section that has changed since (issues "honest numbers", 45)."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import headlines  # noqa: E402


def test_every_shown_headline_is_what_the_current_results_render():
    assert headlines.readme_block() is not None, "README.md has no headlines markers"
    assert headlines.report_block() is not None, "benchmarks/results/REPORT.md has no Headlines section"
    problems = headlines.out_of_date()
    assert not problems, "\n".join(problems) + "\n(never edit a block or a quote by hand)"


def _outside_quotes(text: str) -> str:
    text = re.sub(re.escape(headlines.BEGIN) + ".*?" + re.escape(headlines.END), "", text, flags=re.S)
    return headlines._QUOTE.sub("", text)


def test_no_doc_types_a_headline_figure_by_hand():
    # the figures a reader would copy: every x-fold speedup and 3-decimal ratio the headlines print
    rendered = headlines.render() + "".join(q(headlines.sources()) for q in headlines.QUOTES.values())
    figures = set(re.findall(r"\b\d+\.\dx\b", rendered)) | set(re.findall(r"\*\*(\d\.\d{3})\*\*", rendered))
    assert figures
    typed = [(os.path.relpath(path, headlines.REPO), f) for path in headlines.quoting_docs()
             for f in figures if re.search(r"(?<![\d.])" + re.escape(f) + r"(?![\d])",
                                           _outside_quotes(open(path).read()))]
    assert not typed, ("headline figures typed by hand (quote them with <!-- headline:NAME --> markers, "
                       f"headlines.QUOTES): {typed}")


def _doc(digest: str | None, commit: str = "0123456789abcdef", dirty: bool = False) -> dict:
    machine = {"git": {"commit": commit, "dirty": dirty}, "time_utc": "2026-12-03T15:24:09Z"}
    if digest is not None:
        machine["source_digest"] = {"deadpool_ext": digest}
    return {"machine": machine}


def test_a_figure_from_the_current_code_names_its_commit_and_date():
    assert headlines.stamp(_doc("abc"), digest="abc") == "commit 0123456789, 2026-12-03, from the current code"
    assert not headlines.is_stale(_doc("abc"), digest="abc")


def test_a_figure_from_other_code_is_marked_stale():
    text = headlines.stamp(_doc("abc", dirty=True), digest="def")
    assert text.startswith("commit 0123456789 + uncommitted changes, 2026-12-03, **stale**")
    assert "`abc`" in text and "def" not in text  # never the checkout's own digest: it changes at every commit
    assert headlines.is_stale(_doc(None), digest="def")
    assert "**stale**: no digest" in headlines.stamp(_doc(None), digest="def")


def test_the_stamp_reaches_the_rendered_block(tmp_path):
    doc = json.loads(open(os.path.join(headlines.RESULTS_DIR, "recovery.json")).read())
    doc["machine"]["source_digest"] = {"deadpool_ext": headlines.checkout_digest()}
    doc["machine"]["deadpool_defaults"] = headlines.deadpool_defaults()
    (tmp_path / "recovery.json").write_text(json.dumps(doc))
    [line] = [ln for ln in headlines.render(str(tmp_path)).splitlines() if ln.startswith("- **Recovery, GPT small")]
    assert "from the current code" in line and "**stale**" not in line
    doc["machine"]["source_digest"] = {"deadpool_ext": "0" * 16}
    (tmp_path / "recovery.json").write_text(json.dumps(doc))
    assert f"**stale**: `deadpool_ext` has changed since (digest `{'0' * 16}` then)" in headlines.render(str(tmp_path))
    doc["machine"]["source_digest"] = {"deadpool_ext": headlines.checkout_digest()}
    doc["machine"]["deadpool_defaults"]["hot_swap"]["in_place"] = False
    (tmp_path / "recovery.json").write_text(json.dumps(doc))
    assert "**stale**: measured under other defaults" in headlines.render(str(tmp_path))


def test_quotes_are_rendered_and_unknown_ones_refused(tmp_path):
    text = "before <!-- headline:recovery (old) -->0.50 s, typed<!-- /headline --> after"
    new = headlines.requote(text)
    [(name, body)] = headlines.quotes_in(new)
    assert name == "recovery" and body == headlines.QUOTES["recovery"](headlines.sources())
    assert new.startswith("before " + headlines.quote_begin("recovery")) and new.endswith(" after")
    with pytest.raises(ValueError, match="unknown headline quote 'nope'; known: recovery"):
        headlines.requote("<!-- headline:nope -->x<!-- /headline -->")
    # no result: the quote says so instead of a figure
    assert headlines.QUOTES["recovery"]({}) == "`benchmarks/results/recovery.md`: not measured yet"


def test_docs_quote_the_recovery_headline():
    quoted = {name for path in headlines.quoting_docs() for name, _ in headlines.quotes_in(open(path).read())}
    assert "recovery" in quoted


def test_a_headline_measured_under_a_changed_default_shows_as_stale():
    # `stale()` names what to re-run (`headlines.py --check`, `python -m benchmarks.refresh`); until then the reader
    # sees the figure marked, in the README and everywhere it is quoted
    block = headlines.render()
    for line in headlines.stale():
        stem = line.split(":", 1)[0]
        if stem == headlines.SIMULATE:
            continue
        shown = [ln for ln in block.splitlines() if f"`{stem}.md`" in ln]
        assert shown and all("**stale**" in ln for ln in shown), f"{stem} is stale but not shown so: {line}"


def test_a_changed_default_names_the_result_to_rerun(tmp_path):
    doc = {"command": "python benchmarks/bench_recovery.py --sizes small", "sizes": {},
           "machine": {"deadpool_defaults": headlines.deadpool_defaults()}}
    doc["machine"]["deadpool_defaults"]["hot_swap"]["in_place"] = False
    (tmp_path / "recovery.json").write_text(json.dumps(doc))
    [line] = headlines.stale(str(tmp_path))
    assert line.startswith("recovery: measured under other defaults (hot_swap.in_place (False then, True now))")
    assert "python benchmarks/bench_recovery.py --sizes small" in line


def test_a_result_without_recorded_defaults_is_stale(tmp_path):
    (tmp_path / "recovery.json").write_text(json.dumps({"command": "x", "sizes": {}, "machine": {}}))
    assert headlines.stale(str(tmp_path)) == ["recovery: records no deadpool defaults; re-run `x`"]


@pytest.mark.parametrize("rule, rule_met, used", [("window", True, True), ("window", False, False),
                                                  (None, True, False)])
def test_only_overhead_results_counted_whole_are_headlines(tmp_path, rule, rule_met, used):
    doc = {"sizes": {"small": {"analysis": {"rule": rule}, "rule_met": rule_met}}}
    (tmp_path / "snapshot_overhead_small_n2.json").write_text(json.dumps(doc))
    assert ("snapshot_overhead_small_n2" in headlines.sources(str(tmp_path))) is used


def test_the_simulators_code_is_apart_from_the_measured_code(tmp_path):
    """A re-calibration of the simulator (``deadpool_ext/sim``) leaves the measured figures current; the
    simulation's own result is stale when the simulator changed."""
    import common

    root = tmp_path / "deadpool_ext"
    (root / "sim").mkdir(parents=True)
    (root / "run.py").write_text("x = 1\n")
    (root / "sim" / "params.py").write_text("STARTUP_S = 9.0\n")
    measured = common.tree_digest(str(root), exclude=(common.SIM,))
    (root / "sim" / "params.py").write_text("STARTUP_S = 9.1\n")
    assert common.tree_digest(str(root), exclude=(common.SIM,)) == measured
    (root / "run.py").write_text("x = 2\n")
    assert common.tree_digest(str(root), exclude=(common.SIM,)) != measured
    doc = _doc(headlines.checkout_digest())
    assert not headlines.sim_changed("recovery_nodes", doc)
    assert headlines.sim_changed(headlines.SIMULATE, doc)  # no simulator digest recorded
    doc["machine"]["source_digest"][headlines.SIM_CODE] = common.source_digests()[headlines.SIM_CODE]
    assert not headlines.sim_changed(headlines.SIMULATE, doc)
    assert "`deadpool_ext/sim` has changed since" in headlines.stamp(_doc(headlines.checkout_digest()),
                                                                     stem=headlines.SIMULATE)
