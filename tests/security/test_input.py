"""Bad input gets one line (issue 14, item 8): the ``deadpool`` config section and ``deadpool-run``'s flags.

Config: every number is finite and in range (NaN and Infinity, which Python's ``json`` accepts as literals, are
refused naming the key), ``"deadpool": null`` is refused with the way to turn the extension off, and nothing but
:class:`ConfigError` comes out of the loader. Launcher: every bad flag ends ``deadpool-run`` at once with one line
naming the flag and no traceback, before any worker starts; so does a missing or unrunnable script.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import socket
import subprocess
import time
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deadpool_ext.config import ConfigError, DeadpoolConfig, split_deepspeed_config
from deadpool_ext.launcher import cli
from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.jobs import Job, deadpool_run
from deadpool_ext.testing.launch import REPO, base_env

# -- the config section --------------------------------------------------------------------------------------


def _leaves(cls: type = DeadpoolConfig, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """Every leaf of the section's schema: (key path, type hint)."""
    out: list[tuple[tuple[str, ...], object]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _leaves(typing.cast(type, hint), (*prefix, f.name))
        else:
            out.append(((*prefix, f.name), hint))
    return out


LEAVES = _leaves()
NUMBER_LEAVES = [path for path, hint in LEAVES if hint in (int, float)]
INT_LEAVES = [path for path, hint in LEAVES if hint is int]
FLOAT_LEAVES = [path for path, hint in LEAVES if hint is float]


def _nest(path: tuple[str, ...], value: object) -> dict[str, object]:
    section: object = value
    for key in reversed(path):
        section = {key: section}
    return typing.cast(dict, section)


def _key(path: tuple[str, ...]) -> str:
    return "deadpool." + ".".join(path)


def _refused(section: object, key: str) -> str:
    with pytest.raises(ConfigError) as err:
        DeadpoolConfig.from_dict(section)
    msg = str(err.value)
    assert key in msg, msg
    assert "\n" not in msg
    return msg


def test_schema_has_the_number_fields_the_checks_cover():
    assert ("recovery", "timeout_s") in FLOAT_LEAVES and ("local", "keep_after_exit_s") in FLOAT_LEAVES
    assert ("snapshot", "interval") in INT_LEAVES and len(NUMBER_LEAVES) >= 16


def test_nan_recovery_timeout_is_refused_naming_the_key():
    msg = _refused({"recovery": {"timeout_s": math.nan}}, "deadpool.recovery.timeout_s")
    assert "finite number" in msg and "> 0" in msg and "nan" in msg


def test_infinite_keep_after_exit_is_refused_naming_the_key():
    msg = _refused({"local": {"keep_after_exit_s": math.inf}}, "deadpool.local.keep_after_exit_s")
    assert "finite number" in msg and "inf" in msg


@pytest.mark.parametrize("path", NUMBER_LEAVES, ids=".".join)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nan_or_infinity_in_any_number_field_is_refused(path, value):
    _refused(_nest(path, value), _key(path))


@pytest.mark.parametrize("path", FLOAT_LEAVES, ids=".".join)
def test_huge_integer_in_a_float_field_is_refused(path):
    # float(10**400) raises OverflowError: it used to escape the loader as that, not as a ConfigError.
    _refused(_nest(path, 10**400), _key(path))


@pytest.mark.parametrize("path", FLOAT_LEAVES, ids=".".join)
def test_duration_or_rate_beyond_its_range_is_refused(path):
    # Durations: beyond a week (1e300 s would keep memory or a wait forever); the write rate cap: negative.
    _refused(_nest(path, -1.0 if path == ("persist", "max_mb_s") else 1e300), _key(path))


@pytest.mark.parametrize("path", INT_LEAVES, ids=".".join)
@pytest.mark.parametrize("value", [1.0, 2.5, True, "1"], ids=["float", "fraction", "bool", "string"])
def test_integer_field_given_a_float_bool_or_string_is_refused(path, value):
    _refused(_nest(path, value), _key(path))


@pytest.mark.parametrize("path", FLOAT_LEAVES, ids=".".join)
def test_number_field_given_a_bool_is_refused(path):
    _refused(_nest(path, True), _key(path))


def test_chunk_size_beyond_its_range_is_refused():
    _refused({"snapshot": {"chunk_mb": 10**6}}, "deadpool.snapshot.chunk_mb")


@pytest.mark.parametrize("literal,path", [
    ('{"recovery": {"timeout_s": NaN}}', ("recovery", "timeout_s")),
    ('{"local": {"keep_after_exit_s": Infinity}}', ("local", "keep_after_exit_s")),
    ('{"persist": {"max_mb_s": -Infinity}}', ("persist", "max_mb_s")),
    ('{"hot_swap": {"collective_timeout_s": 1e999}}', ("hot_swap", "collective_timeout_s")),
], ids=["NaN", "Infinity", "-Infinity", "1e999"])
def test_json_nan_and_infinity_literals_in_a_config_file_are_refused(tmp_path, literal, path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": 1, "deadpool": ' + literal + "}")
    with pytest.raises(ConfigError, match=_key(path).replace(".", r"\.")):
        split_deepspeed_config(str(cfg))


def test_null_section_is_refused_with_the_way_to_turn_the_extension_off():
    with pytest.raises(ConfigError) as err:
        split_deepspeed_config({"train_micro_batch_size_per_gpu": 1, "deadpool": None})
    msg = str(err.value)
    assert "deadpool" in msg and "null" in msg and '"deadpool": {"enabled": false}' in msg and "remove" in msg


def test_null_section_in_a_config_file_is_refused(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": 1, "deadpool": null}')
    with pytest.raises(ConfigError, match='"enabled": false'):
        split_deepspeed_config(str(cfg))


def test_from_dict_of_none_is_refused():
    # Reached by a caller that looked the section up itself (raw.get("deadpool")) and found null.
    with pytest.raises(ConfigError, match='"enabled": false'):
        DeadpoolConfig.from_dict(None)


def test_absent_section_still_means_no_extension_and_enabled_false_still_turns_it_off():
    assert split_deepspeed_config({"train_micro_batch_size_per_gpu": 1}) == ({"train_micro_batch_size_per_gpu": 1},
                                                                              None)
    _, dp = split_deepspeed_config({"deadpool": {"enabled": False}})
    assert dp is not None and dp.enabled is False


@pytest.mark.parametrize("section", [[], 0, "", False], ids=["list", "zero", "empty-string", "false"])
def test_falsy_non_object_section_is_refused_not_read_as_defaults(section):
    _refused(section, "deadpool")


def test_non_string_key_is_refused():
    # Two keys of different types: sorting them to name the first unknown one used to raise TypeError.
    _refused({1: 2, "x": 3}, "deadpool")


def test_unknown_key_with_a_newline_stays_one_line():
    msg = _refused({"snapshot\nx": 1}, "deadpool.")
    assert "unknown key" in msg


def test_huge_integer_in_a_string_field_gives_a_short_message():
    # repr() of a 5000-digit int raises ValueError in Python >= 3.11; the message must not.
    msg = _refused({"job_id": 10**5000}, "deadpool.job_id")
    assert len(msg) < 300


def test_missing_config_file_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="nope.json: cannot read it: No such file"):
        split_deepspeed_config(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("text", ["{", "\xff\xfe", "[" * 100000], ids=["truncated", "not-utf8", "too-deep"])
def test_malformed_config_file_is_one_config_error(tmp_path, text):
    cfg = tmp_path / "ds.json"
    cfg.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match="ds.json: not valid JSON"):
        split_deepspeed_config(str(cfg))


# -- config fuzzing -------------------------------------------------------------------------------------------

_SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0, -1, 1, 2, 10**20, 1e308, -0.0, 604800, 604801]),
    st.text(max_size=20), st.sampled_from(["fused", "stepwise", "none", "bf16", "info", "debug", "job-1", "/tmp"]),
)
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=8)


_EDGES = st.sampled_from([math.nan, math.inf, -math.inf, 10**400, -(10**400), -1, 0, 1e300, True, 2.5])
_ENUMS = {"log_level": ["debug", "info", "warning", "error"], "compression": ["none", "bf16"],
          "replay": ["fused", "stepwise"]}


def _typed(name: str, hint: object) -> st.SearchStrategy:
    """Values of the leaf's own type and in its range (so that whole sections are often accepted and round-trip;
    the bad values come from mixing in ``_VALUES``)."""
    if name in _ENUMS:
        return st.sampled_from(_ENUMS[name])
    if name == "job_id":
        return st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True))
    if hint is bool:
        return st.booleans()
    if hint is int:
        return _mostly(st.integers(min_value=2, max_value=64), _EDGES)
    if hint is float:
        return _mostly(st.one_of(st.floats(min_value=0.001, max_value=600000.0),
                                 st.integers(min_value=1, max_value=1000)), _EDGES)
    return st.text(st.characters(blacklist_characters="\0"), min_size=1, max_size=20)


def _schema_section(cls: type = DeadpoolConfig) -> st.SearchStrategy[dict]:
    """Dicts shaped like the section: known keys (each maybe present) with values mostly of their own type and
    now and then anything, nested sections recursed into, now and then an unknown key."""
    hints = typing.get_type_hints(cls)
    parts: dict[str, st.SearchStrategy] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        parts[f.name] = _mostly(_schema_section(typing.cast(type, hint)) if dataclasses.is_dataclass(hint)
                                else _typed(f.name, hint), _VALUES)
    known = st.fixed_dictionaries({}, optional=parts)
    return _mostly(known, st.builds(lambda d, extra: {**d, **extra}, known,
                                    st.dictionaries(st.text(max_size=8), _VALUES, min_size=1, max_size=2)))


def _mostly(usual: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """``usual`` about 9 times in 10, ``rare`` otherwise (``one_of`` would pick each about as often)."""
    return st.integers(min_value=0, max_value=9).flatmap(lambda i: rare if i == 5 else usual)


def _check_loaded(cfg: DeadpoolConfig) -> None:
    """An accepted config round-trips, and holds only finite numbers (json without NaN/Infinity writes it)."""
    data = cfg.to_dict()
    text = json.dumps(data, allow_nan=False)
    assert DeadpoolConfig.from_dict(json.loads(text)) == cfg
    assert DeadpoolConfig.from_dict(data) == cfg


@given(_schema_section())
def test_fuzz_config_from_dict_schema_shaped(section):
    """Schema-shaped sections with random values: ConfigError (one line, naming a deadpool key) or a config that
    round-trips."""
    try:
        cfg = DeadpoolConfig.from_dict(section)
    except ConfigError as exc:
        assert str(exc).startswith("deadpool config: deadpool") and "\n" not in str(exc)
        return
    _check_loaded(cfg)


@given(_VALUES)
def test_fuzz_config_from_dict_any_value(section):
    """Anything JSON-like (and more: huge integers, NaN, non-finite floats): ConfigError or a round-tripping
    config."""
    try:
        cfg = DeadpoolConfig.from_dict(section)
    except ConfigError:
        return
    _check_loaded(cfg)


@given(st.sampled_from(LEAVES).flatmap(lambda leaf: st.tuples(st.just(leaf[0]),
                                                                st.one_of(_typed(leaf[0][-1], leaf[1]), _EDGES,
                                                                          _VALUES))))
def test_fuzz_config_one_bad_leaf_is_named(leaf):
    """One leaf set to a value of its type or to anything: refused naming exactly that key, or accepted and
    round-trips."""
    path, value = leaf
    try:
        cfg = DeadpoolConfig.from_dict(_nest(path, value))
    except ConfigError as exc:
        assert _key(path) in str(exc), str(exc)
        return
    _check_loaded(cfg)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fuzz-input"))


@given(text=st.one_of(st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                      st.builds(lambda s: json.dumps({"deadpool": s}, allow_nan=True), _schema_section()),
                      st.builds(lambda v: json.dumps(v, allow_nan=True), _VALUES)))
def test_fuzz_split_deepspeed_config_file_text(fuzz_dir, text):
    """Any file text (bytes, JSON with NaN/Infinity literals, schema-shaped sections): ConfigError or a config
    that round-trips."""
    path = os.path.join(fuzz_dir, "ds.json")
    with open(path, "w", encoding="latin-1") as fh:
        fh.write(text)
    try:
        _, cfg = split_deepspeed_config(path)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    if cfg is not None:
        _check_loaded(cfg)


# -- deadpool-run ---------------------------------------------------------------------------------------------

# The worker script every launcher test passes: it records that it ran. None may have run after a refusal.
_WORKER = 'import sys\nopen(sys.argv[1], "w").write("started")\n'


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return base_env({"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra or {})})


@pytest.fixture
def job(tmp_path):
    """Runs deadpool-run with the flags verbatim (wrong ones too) and the worker script; checks that it refused
    fast and started no worker, and returns the finished process (its stderr is checked by the caller)."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    marker = tmp_path / "started"

    def run(*flags: str, script_path: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        cmd = deadpool_run(*flags, script_path or str(script), str(marker))
        t0 = time.monotonic()
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(env), cwd=str(tmp_path))
        elapsed = time.monotonic() - t0
        assert res.returncode != 0, res.stderr
        assert not marker.exists(), "a worker started"
        assert elapsed < 30, f"took {elapsed:.1f}s to refuse"
        return res

    run.marker = marker
    run.script = script
    return run


def _refusal(flags: list[str], says: str, *also: str, script: str | None = None, env: dict[str, str] | None = None,
             one_line: bool = True, id: str) -> typing.Any:  # noqa: A002 - pytest.param's name
    """A bad launch: its flags and what the last line of stderr says: ``deadpool-run: <says>...``, containing each
    of ``also``. ``{tmp}``, ``{hostfile}``, ``{fifo}``, ``{bad}``, ``{taken}`` are filled in by the test."""
    return pytest.param(flags, says, also, script, env, one_line, id=id)


_DURATION_FLAGS = ("--heartbeat-s", "--watch-s", "--detect-timeout-s", "--spare-wait-s", "--suspect-age-s",
                   "--preempt-grace-s")
_SLURM = ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
_REFUSALS = [
    *(_refusal(["--nnodes", "1", "--host", host], f"--host {host!r}: a wildcard address", "interface", id=name)
      for name, host in (("wildcard-ipv4", "0.0.0.0"), ("wildcard-ipv6", "::"), ("wildcard-empty", ""))),
    _refusal(["--nnodes", "1", "--host", "192.0.2.1"], "--host 192.0.2.1: not an address of this host",
             id="host-not-here"),  # TEST-NET-1 (RFC 5737): never a local address
    _refusal(["--nnodes", "1", "--host", "no-such-host.invalid"], "--host no-such-host.invalid: cannot resolve it",
             id="host-unresolvable"),
    *(_refusal(["--nnodes", "1", "--store-url", url], f"--store-url {url!r}: ", id=f"store-url-{name}")
      for name, url in (("scheme", "http://127.0.0.1:1"), ("no-port", "dp://127.0.0.1"),
                        ("port-range", "dp://127.0.0.1:99999"), ("no-host", "etcd://:2379"),
                        ("path", "dp://h:1/path"), ("empty", ""))),
    _refusal(["--nnodes", "1", "--timeline", "{tmp}/no/such/t.jsonl"],
             "--timeline {tmp}/no/such/t.jsonl: cannot open it for appending", id="timeline-missing-dir"),
    _refusal(["--nnodes", "1", "--timeline", "{tmp}"], "--timeline {tmp}: cannot open it for appending",
             id="timeline-a-directory"),
    *(_refusal(["--nnodes", "1", "--store-port", port], f"--store-port {port}: must be an integer in 0..65535",
               id=f"store-port-{port}") for port in ("70000", "-1", "65536")),
    *(_refusal(flags, "", flag, id=f"count-{flag}") for flags, flag in (
        (["--nnodes", "0"], "--nnodes 0"),
        (["--nnodes", "10000000"], "--nnodes 10000000"),
        (["--nnodes", "1", "--nproc-per-node", "0"], "--nproc-per-node 0"),
        (["--nnodes", "1", "--nproc-per-node", "5000"], "--nproc-per-node 5000"),
        (["--nnodes", "1", "--spare-nodes", "-1"], "--spare-nodes -1"),
        (["--nnodes", "60000", "--nproc-per-node", "1000"], "60000000 workers, at most"),
        (["--nnodes", "1", "--hosts", "0"], "--hosts 0"),
        (["--nnodes", "1", "--host-rank", "3"], "--host-rank 3"),
        (["--nnodes", "abc"], "--nnodes"))),
    *(_refusal(["--nnodes", "1", "--detect-timeout-s", "5", flag, value], flag, "seconds", id=f"{flag}={value}")
      for flag in _DURATION_FLAGS for value in ("nan", "inf", "-1", "1e9")),
    *(_refusal(["--nnodes", "1", flag, value], f"{flag} {shown}: must be", id=f"{flag}={value}")
      for flag, value, shown in (("--straggler-action", "evict", "evict"), ("--straggler-factor", "1", "1.0"),
                                 ("--straggler-factor", "nan", "nan"), ("--straggler-window", "0", "0.0"),
                                 ("--straggler-window", "inf", "inf"), ("--straggler-window", "-5", "-5.0"))),
    *(_refusal(["--nnodes", "1", *flags], "", needle, id=f"multi-host-{i}") for i, (flags, needle) in enumerate((
        (["--leader-ttl-s", "1"], "--leader-ttl-s 1: must be an integer in 2..3600"),
        (["--progress-timeout-s", "-1"], "--progress-timeout-s -1.0: must be a finite number of seconds"),
        (["--progress-timeout-s", "0.2"], "--progress-timeout-s (0.2) must be longer than --heartbeat-s"),
        (["--suspect-age-s", "0.3"], "--suspect-age-s 0.3: must be a number of seconds longer than --heartbeat-s"),
        (["--hostfile", "/nonexistent/hostfile"], "--hostfile /nonexistent/hostfile: cannot read it"),
        (["--hostfile", "/dev/null", "--from-slurm"], "--hostfile and --from-slurm: pass one of them"),
        (["--hostfile", "/dev/null"], "/dev/null: no hosts")))),
    _refusal(["--nnodes", "1", "--hostfile", "{hostfile}"], "", "no entry names this machine", "127.0.0.1",
             id="hostfile-without-this-machine"),
    _refusal(["--nnodes", "1", "--from-slurm"], "",
             "SLURM's environment lacks SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID", id="from-slurm-outside-slurm"),
    *(_refusal(["--nnodes", "1", f"--job-id={job_id}"], f"--job-id {job_id!r}: must be", id=f"job-id-{job_id[:8]}")
      for job_id in ("../x", "-x", "a" * 65, "a.b", "a/b")),
    _refusal(["--nnodes", "1"], "script scripts/nope.py: no such file", script="scripts/nope.py",
             id="script-missing"),
    _refusal(["--nnodes", "1"], "script {tmp}: is a directory, not a Python script", script="{tmp}",
             id="script-a-directory"),
    _refusal(["--nnodes", "1"], "script {fifo}: not a regular file", script="{fifo}", id="script-a-fifo"),
    _refusal(["--nnodes", "1"], "script {bad}: not a runnable Python script", script="{bad}",
             id="script-not-python"),
    _refusal(["--nnodes", "1"], "DEADPOOL_LOG_LEVEL='loud': must be one of DEBUG, INFO",
             env={"DEADPOOL_LOG_LEVEL": "loud"}, id="log-level-variable"),
    *(_refusal([*flags, "--nnodes", "2"], "", needle, id=f"timing-{i}") for i, (flags, needle) in enumerate((
        (["--heartbeat-s", "0"], "--heartbeat-s must be a positive number of seconds"),
        (["--watch-s", "-1"], "--watch-s must be a positive number of seconds"),
        (["--detect-timeout-s", "0.4", "--heartbeat-s", "0.5"],
         "--detect-timeout-s (0.4) must be longer than --heartbeat-s"),
        (["--malloc-arena-max", "-1"], "--malloc-arena-max -1: must be an integer in 0..1024")))),
    *(_refusal(flags, "", needle, id=f"join-{i}") for i, (flags, needle) in enumerate((
        (["--join", "extra0", "--nnodes", "2"], "--join: --nnodes belong to the job's own launchers; drop them"),
        (["--join", "extra0"], "--join needs the running job's --store-url and --job-id"),
        (["--join", "x/../y", "--store-url", "dp://h:1", "--job-id", "j"], "--join 'x/../y': a node name of 1-63"),
        ([], "--nnodes is required (or --join NAME, to add this machine to a running job)")))),
    # after the checks: a start-up error (the store's port is taken) is one line too, after the log's lines
    _refusal(["--nnodes", "1", "--store-port", "{taken}"],
             "cannot start the job: StoreError: cannot bind the coordination store", "{taken}", "--debug",
             one_line=False, id="start-up-error"),
]


@pytest.mark.parametrize("flags,says,also,script,env,one_line", _REFUSALS)
def test_a_bad_launch_is_refused_in_one_line_before_any_worker(job, tmp_path, monkeypatch, flags, says, also,
                                                              script, env, one_line):
    """Every refusal of deadpool-run: a nonzero exit, no worker started, no traceback, and one line on stderr
    that names the flag, variable or file and what is allowed (the start-up error: the last line)."""
    for name in _SLURM:
        monkeypatch.delenv(name, raising=False)
    with contextlib.ExitStack() as stack:
        fill = {"tmp": str(tmp_path), "hostfile": str(tmp_path / "hostfile"), "fifo": str(tmp_path / "fifo.py"),
                "bad": str(tmp_path / "bad.py"), "taken": ""}
        (tmp_path / "hostfile").write_text("192.0.2.10 slots=1\n192.0.2.11 slots=1\n")
        (tmp_path / "bad.py").write_text("def f(:\n")
        os.mkfifo(tmp_path / "fifo.py")
        if "{taken}" in flags:
            taken = stack.enter_context(socket.socket())
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            fill["taken"] = str(taken.getsockname()[1])
        res = job(*(f.format(**fill) for f in flags), script_path=script.format(**fill) if script else None, env=env)
    lines = res.stderr.strip().splitlines()
    says, also = "deadpool-run: " + says.format(**fill), [a.format(**fill) for a in also]
    assert "Traceback" not in res.stderr and (len(lines) == 1 or not one_line) and lines[-1].startswith(says) \
        and all(a in lines[-1] for a in also), res.stderr  # log-interface: the refusal names what to fix


def test_debug_shows_the_traceback_of_a_start_up_error(job):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        launch = Job(script=str(job.script), args=(str(job.marker),), nnodes=1, port=taken.getsockname()[1],
                     launcher_flags=("--debug",))
        res = subprocess.run(launch.argv(), capture_output=True, text=True, timeout=120, env=_env())
    assert res.returncode != 0 and "Traceback" in res.stderr and "StoreError" in res.stderr  # log-interface: --debug
    assert not job.marker.exists()


def test_a_valid_launch_still_runs_the_script(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    marker = tmp_path / "started"
    timeline = tmp_path / "t.jsonl"
    launch = Job(script=str(script), args=(str(marker),), nnodes=1, host="localhost", timeline=str(timeline))
    res = subprocess.run(launch.argv(), capture_output=True, text=True, timeout=120, env=_env())
    assert res.returncode == 0, res.stderr
    assert marker.read_text() == "started" and [e for e in read_events(str(timeline)) if e["event"] == "finished"]


# -- launcher fuzzing -----------------------------------------------------------------------------------------

_FLAG_VALUES = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "0", "1", "65535", "65536", "", "-", "--", "0x10", "1_0"]),
    st.text(max_size=12),
)
_FLAGS = ["--nnodes", "--nproc-per-node", "--spare-nodes", "--job-id", "--store-url", "--store-port", "--hosts",
          "--host-rank", "--shm-root", "--heartbeat-s", "--watch-s", "--detect-timeout-s", "--spare-wait-s",
          "--no-spare-policy", "--leader-ttl-s", "--progress-timeout-s"]
_HOSTS = st.one_of(st.sampled_from(["127.0.0.1", "::1", "localhost", "0.0.0.0", "::", "", "192.0.2.1", "1.2.3"]),
                   st.ip_addresses().map(str))


@given(flags=st.lists(st.tuples(st.sampled_from(_FLAGS), _FLAG_VALUES), max_size=6), host=_HOSTS,
       script=st.sampled_from(["worker", "missing", "directory"]))
def test_fuzz_launcher_flags(fuzz_dir, flags, host, script):
    """deadpool-run's command-line checks over random flag values: a refusal is SystemExit(2) with one line on
    stderr naming the problem; nothing else escapes; what passes is in range."""
    os.makedirs(os.path.join(fuzz_dir, "dir"), exist_ok=True)
    worker = os.path.join(fuzz_dir, "worker.py")
    with open(worker, "w") as fh:
        fh.write(_WORKER)
    script_path = {"worker": worker, "missing": os.path.join(fuzz_dir, "nope.py"),
                   "directory": os.path.join(fuzz_dir, "dir")}[script]
    argv = ["--nnodes", "1", "--host", host]
    for flag, value in flags:
        argv += [f"{flag}={value}"]
    argv.append(script_path)
    parser = cli.build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
            cli.check_args(parser, args)
    except SystemExit as exc:
        assert exc.code == 2
        # one line (what each says: test_a_bad_launch_is_refused_in_one_line_before_any_worker)
        assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()
        return
    assert isinstance(args, argparse.Namespace) and script == "worker"
    assert 1 <= args.nnodes <= cli.MAX_NODES and 0 <= args.store_port <= 65535
    for name in ("heartbeat_s", "watch_s", "detect_timeout_s", "spare_wait_s"):
        assert math.isfinite(getattr(args, name)) and 0 <= getattr(args, name) <= cli.MAX_SECONDS
