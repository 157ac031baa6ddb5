"""Where a test may read log text: the rule, its counter, and the one helper for refusals.

The rule (issue 31, part 7): a test asserts on what the system decided (timeline events, typed stats, return
values, exception types and fields, exit codes, the files and store keys written), not on the words it printed.
Log text is asserted only where the message *is* the interface: a refusal or a one-line error on bad input, whose
words are what the user reads to fix the input. Those sites are marked and there are at most ``LIMIT`` of them.

*Log text* is text captured from a stream or a logger, not a value handed back to the caller:

- a process's output: ``.output``, ``.stdout`` or ``.stderr`` of any object (a ``subprocess`` result, a job run);
- captured streams: ``capsys.readouterr()`` / ``capfd.readouterr()`` and their ``.out`` / ``.err``, a
  ``StringIO``'s ``.getvalue()``;
- captured logs: ``caplog.text``, ``caplog.messages`` (of any name containing ``log``), a record's ``.message`` or
  ``.getMessage()``;
- a file's or stream's raw text read back (``.read()`` / ``.read_text()`` / ``.readline()`` / ``.readlines()``)
  when the file expression names a log, an output or a timeline (``log``, ``out``, ``err``, ``timeline`` in its
  source), and a list that collects such text (``lines.append(line)``);
- a call of a function of the same module that returns one of these (a fixture's runner returning a stderr line);
- any name assigned from one of these through string operations only (methods, slicing, ``join``, f-strings,
  comprehensions, ``or`` / conditional). A call to a free function (``json.loads``, ``summary(res)``,
  ``read_events``) parses the text into typed values and ends it: asserting on those is asserting on a decision.

A *log-text assertion* is one ``assert`` statement whose test checks such text: ``x in text`` / ``not in``,
``text == ...`` / ``!=``, ``text.count(...)``, ``.startswith`` / ``.endswith`` / ``.find`` / ``.index``, or
``re.search`` / ``match`` / ``fullmatch`` / ``findall`` over it (anywhere in the test, comprehensions included).
A call of a function of the module that returns such a check (``assert said("key")``) is one too.
The assertion's failure message (after the comma) is not part of the test and is never counted. A string that a
function returns (a message builder such as ``stop_line``) or an exception's message is a value the caller
receives and is not log text.

A helper of a module (a function not named ``test*``) that makes log-text assertions counts once per call
instead (``assert_one_line(res, "names the file")`` called twelve times is twelve).

A log-text assertion is *marked* when a line of it carries ``# log-interface: <why the message is the
interface>``; each call of :func:`assert_refusal` counts as one marked assertion. Every log-text assertion must
be marked, and at most ``LIMIT`` are (tests/unit/test_log_assertions.py enforces both).
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass

LIMIT = 20
MARK = "# log-interface:"
HELPER = "assert_refusal"
ROOTS = ("tests",)
"""Searched for test modules (``tests/chaos`` is the chaos suite's tests; the repository has no other)."""

_STREAM_ATTRS = {"output", "stdout", "stderr"}
_CAPTURED_ATTRS = {"out", "err"}
_STR_METHODS = {"strip", "lstrip", "rstrip", "splitlines", "split", "rsplit", "lower", "upper", "replace",
                "partition", "rpartition", "join", "casefold", "removeprefix", "removesuffix", "decode",
                "expandtabs", "title"}
_CHECK_METHODS = {"count", "startswith", "endswith", "find", "index", "rfind", "rindex"}
_RE_FUNCS = {"search", "match", "fullmatch", "findall", "finditer"}
_FILE_READS = {"read", "read_text", "readline", "readlines", "read_bytes"}
_FILE_HINTS = re.compile(r"log|timeline|stdout|stderr|output|\.out\b|\.err\b|\bout\b|\berr\b")


def assert_refusal(result, *, rc: int, names: str) -> None:
    """The one check a refusal or one-line error gets: exit status ``rc``, no traceback, and a line of stderr that
    names ``names`` (the key, flag or file to fix). ``result`` is a ``subprocess.CompletedProcess`` or an
    ``(rc, stderr)`` pair (``main(argv)`` called in process, its stderr captured). Each call site counts as one
    marked log-text assertion."""
    code, err = (result.returncode, result.stderr) if hasattr(result, "returncode") else result
    assert code == rc, f"exit status {code}, expected {rc}: {err[-2000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert any(names in line for line in err.splitlines()), f"{names!r} not named on stderr: {err[-2000:]}"


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    marked: bool
    source: str


class _Text:
    """Decides whether an expression is log text, given the names a function bound to log text so far."""

    def __init__(self, functions: frozenset[str] = frozenset(), checkers: frozenset[str] = frozenset()) -> None:
        self.functions = functions  # this module's functions (fixtures included) that return log text
        self.checkers = checkers    # ... and those that return a check of log text (``said("key")``)
        self.names: set[str] = set()
        self.captures: set[str] = set()  # names bound to a readouterr() result

    def is_text(self, e: ast.AST) -> bool:
        if isinstance(e, ast.Name):
            return e.id in self.names
        if isinstance(e, ast.Attribute):
            if e.attr in _STREAM_ATTRS or e.attr == "message":
                return True
            if e.attr in _CAPTURED_ATTRS:
                return self._is_capture(e.value)
            if e.attr in ("text", "messages") and isinstance(e.value, ast.Name) and "log" in e.value.id:
                return True  # caplog.text, or a caplog fixture under another name (store_log.text)
            return False
        if isinstance(e, ast.Subscript):
            return self.is_text(e.value)
        if isinstance(e, ast.Call):
            f = e.func
            if (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "") in self.functions:
                return True
            if isinstance(f, ast.Attribute):
                if f.attr in ("getMessage", "getvalue"):  # a record's message; a captured StringIO
                    return True
                if f.attr in _FILE_READS:
                    return bool(_FILE_HINTS.search(ast.unparse(f.value).lower()))
                if f.attr in _STR_METHODS:
                    return self.is_text(f.value) or any(self.is_text(a) for a in e.args)
                return False
            if isinstance(f, ast.Name) and f.id == "str":
                return any(self.is_text(a) for a in e.args)
            return False
        if isinstance(e, ast.JoinedStr):
            return any(self.is_text(v.value) for v in e.values if isinstance(v, ast.FormattedValue))
        if isinstance(e, ast.BinOp):
            return self.is_text(e.left) or self.is_text(e.right)
        if isinstance(e, ast.BoolOp):
            return any(self.is_text(v) for v in e.values)
        if isinstance(e, ast.IfExp):
            return self.is_text(e.body) or self.is_text(e.orelse)
        if isinstance(e, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            self._bind_comprehension(e)
            return self.is_text(e.elt)
        if isinstance(e, (ast.List, ast.Tuple)):
            return any(self.is_text(v) for v in e.elts)
        return False

    def _is_capture(self, e: ast.AST) -> bool:
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "readouterr":
            return True
        return isinstance(e, ast.Name) and e.id in self.captures

    def _bind_comprehension(self, e: ast.AST) -> None:
        for gen in getattr(e, "generators", []):
            it = gen.iter
            caplog_records = (isinstance(it, ast.Attribute) and it.attr == "records"
                              and isinstance(it.value, ast.Name) and it.value.id == "caplog")
            if self.is_text(it) and not caplog_records:
                for n in ast.walk(gen.target):
                    if isinstance(n, ast.Name):
                        self.names.add(n.id)

    def bind(self, node: ast.AST) -> None:
        """Follow an assignment or a ``for``: names bound from log text are log text."""
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            value = node.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if value is None:
                return
            capture = self._is_capture(value) or (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                                                  and value.func.attr == "readouterr")
            text = self.is_text(value)
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        if capture:
                            self.captures.add(n.id)
                        elif text:
                            self.names.add(n.id)
                        elif not isinstance(node, ast.AugAssign):
                            self.names.discard(n.id)
        elif isinstance(node, ast.For) and self.is_text(node.iter):
            for n in ast.walk(node.target):
                if isinstance(n, ast.Name):
                    self.names.add(n.id)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func  # lines.append(line): a list collecting log text is log text
            if (isinstance(f, ast.Attribute) and f.attr in ("append", "extend") and isinstance(f.value, ast.Name)
                    and any(self.is_text(a) for a in node.value.args)):
                self.names.add(f.value.id)

    def checks(self, test: ast.AST) -> bool:
        """Whether an assert's test checks log text."""
        for n in ast.walk(test):
            if isinstance(n, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
                self._bind_comprehension(n)
        for n in ast.walk(test):
            if isinstance(n, ast.Compare):
                sides = [n.left, *n.comparators]
                for op, left, right in zip(n.ops, sides, sides[1:]):
                    if isinstance(op, (ast.In, ast.NotIn)) and self.is_text(right):
                        return True
                    if isinstance(op, (ast.Eq, ast.NotEq)) and (self.is_text(left) or self.is_text(right)):
                        return True
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in self.checkers:
                return True
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                if n.func.attr in _CHECK_METHODS and self.is_text(n.func.value):
                    return True
                if (n.func.attr in _RE_FUNCS and isinstance(n.func.value, ast.Name) and n.func.value.id == "re"
                        and any(self.is_text(a) for a in n.args)):
                    return True
        return False


def _functions(tree: ast.Module) -> list[ast.AST]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _ordered(body: list[ast.stmt]) -> list[ast.AST]:
    """A function's statements in source order, nested blocks included but not nested functions."""
    out: list[ast.AST] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            sub = getattr(stmt, field, None)
            if isinstance(sub, list):
                out.extend(_ordered([s for s in sub if isinstance(s, ast.AST)]))  # type: ignore[arg-type]
        if hasattr(ast, "Match") and isinstance(stmt, ast.Match):
            for case in stmt.cases:
                out.extend(_ordered(case.body))
    return out


def _text_functions(tree: ast.Module) -> tuple[frozenset[str], frozenset[str]]:
    """Names of the module's functions that return log text, or return such a function (a fixture handing out a
    runner that returns a process's stderr line): a call of one is log text too. And the names of those that
    return a check of log text (``def said(key): return key in caplog.text``): ``assert said(k)`` counts."""
    found: frozenset[str] = frozenset()
    checkers: set[str] = set()
    for _ in range(4):  # to a fixed point: a function returning one that returns text
        now = set(found)
        for fn in _functions(tree):
            text = _Text(found)
            for node in _ordered(fn.body):  # type: ignore[attr-defined]
                text.bind(node)
                if isinstance(node, ast.Return) and node.value is not None:
                    if text.is_text(node.value) or (isinstance(node.value, ast.Name) and node.value.id in found):
                        now.add(fn.name)  # type: ignore[attr-defined]
                    elif text.checks(node.value):
                        checkers.add(fn.name)  # type: ignore[attr-defined]
        if frozenset(now) == found:
            break
        found = frozenset(now)
    return found - {HELPER}, frozenset(checkers - {HELPER})


def sites_in(path: str, source: str) -> list[Site]:
    """The log-text assertions of one module and the calls of :func:`assert_refusal`."""
    tree = ast.parse(source, filename=path)
    lines = source.splitlines()
    functions, checkers = _text_functions(tree)
    found: list[Site] = []
    for fn in _functions(tree):
        if fn.name == HELPER:  # type: ignore[attr-defined]
            continue
        text = _Text(functions, checkers)
        for node in _ordered(fn.body):  # type: ignore[attr-defined]
            text.bind(node)
            if isinstance(node, ast.With):
                for item in node.items:
                    if item.optional_vars is not None and text.is_text(item.context_expr):
                        for n in ast.walk(item.optional_vars):
                            if isinstance(n, ast.Name):
                                text.names.add(n.id)
            if isinstance(node, ast.Assert) and text.checks(node.test):
                span = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
                found.append(Site(path, node.lineno, any(MARK in ln for ln in span), lines[node.lineno - 1].strip()))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name == HELPER:
                found.append(Site(path, node.lineno, True, lines[node.lineno - 1].strip()))
    # A module's helper (a function not collected as a test) that asserts on log text counts once per call:
    # its own sites give way to its call sites, marked where every site inside it is marked or the call is.
    tests = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.name.startswith("test")}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in tests or fn.name == HELPER:
            continue
        end = fn.end_lineno or fn.lineno
        inside = [s for s in found if fn.lineno <= s.line <= end]
        if not inside:
            continue
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                 and node.func.id == fn.name and not fn.lineno <= node.lineno <= end]
        if not calls:  # a fixture (called by pytest): its own sites stand
            continue
        found = [s for s in found if s not in inside]
        for node in calls:
            span = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
            marked = all(s.marked for s in inside) or any(MARK in ln for ln in span)
            found.append(Site(path, node.lineno, marked, lines[node.lineno - 1].strip()))
    return sorted(set(found), key=lambda s: s.line)


def all_sites(repo: str) -> list[Site]:
    here = os.path.relpath(__file__, repo)
    out: list[Site] = []
    for root in ROOTS:
        for dirpath, dirnames, files in os.walk(os.path.join(repo, root)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), repo)
                if rel == here:
                    continue
                with open(os.path.join(dirpath, f)) as fh:
                    out.extend(sites_in(rel, fh.read()))
    return out
