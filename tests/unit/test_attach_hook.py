"""The zero-code attach path without processes: which config a deepspeed.initialize call carries, the refusal of
an engine built without the section named on the command line, the runner's argument errors, the one-shot import
hook, ``deadpool check``'s "every bad key", and the patches' apply/revert."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types

import pytest

from deadpool_ext.commands.check import all_problems
from deadpool_ext.integrations import deepspeed_hook as hook
from deadpool_ext.integrations import importhook
from deadpool_ext.integrations.importhook import after_import
from deadpool_ext.launcher import contract
from deadpool_ext.testing.launch import REPO, base_env
from tests.log_interface import assert_refusal


def _no_launcher_env() -> dict[str, str]:
    """The test process's environment without any launcher's variables (an earlier in-process test may have set
    MASTER_ADDR and friends): the runner must see a plain, unlaunched process."""
    env = base_env()
    for k in (contract.RANK, contract.WORLD_SIZE, contract.LOCAL_RANK, contract.MASTER_ADDR, contract.MASTER_PORT,
              contract.RESTART_COUNT, contract.USE_AGENT_STORE, contract.STORE):
        env.pop(k, None)
    return env


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(hook, "_state", hook.HookState())
    return hook._state


def test_config_of_call_follows_deepspeeds_order():
    ns = argparse.Namespace(deepspeed_config="from_args.json")
    assert hook.config_of_call((), {"config": {"a": 1}, "config_params": {"b": 2}}) == {"a": 1}
    assert hook.config_of_call((), {"config_params": {"b": 2}}) == {"b": 2}  # Accelerate
    assert hook.config_of_call((ns,), {}) == "from_args.json"
    assert hook.config_of_call((), {"args": ns}) == "from_args.json"
    assert hook.config_of_call((), {"args": argparse.Namespace(device_rank=0), "config": {"c": 3}}) == {"c": 3}
    assert hook.config_of_call((), {"model": object()}) is None


def test_configs_with_section_reads_only_json_files_with_an_enabled_section(tmp_path):
    on = tmp_path / "on.json"
    on.write_text(json.dumps({"train_batch_size": 2, "deadpool": {}}))
    off = tmp_path / "off.json"
    off.write_text(json.dumps({"deadpool": {"enabled": False}}))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"train_batch_size": 2}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    argv = ["--deepspeed", str(on), f"--other={off}", str(plain), str(broken), "--x", "y.json"]
    assert [p for p, _ in hook.configs_with_section(argv)] == [str(on)]
    assert [p for p, _ in hook.configs_with_section([f"--deepspeed_config={on}"])] == [str(on)]


def test_an_engine_without_the_expected_section_is_refused(fresh_state):
    calls = []
    hook.expect_sections(["ds.json"])
    with pytest.raises(hook.NotAttachedError) as err:
        hook._hooked(lambda *a, **k: calls.append(k), (), {"config": {"train_batch_size": 2}})
    msg = str(err.value)
    assert "ds.json (on the command line) has a \"deadpool\" section" in msg and "got a dict without it" in msg
    assert calls == [] and "\n" not in msg  # DeepSpeed never ran: the job does not train unprotected


def test_a_call_without_section_and_nothing_expected_is_deepspeed_unchanged(fresh_state):
    calls = []
    out = hook._hooked(lambda *a, **k: calls.append(k) or "engine", (), {"config": {"train_batch_size": 2}})
    assert out == "engine" and calls == [{"config": {"train_batch_size": 2}}] and fresh_state.plain == 1


def test_after_import_runs_once_right_after_the_module(tmp_path, monkeypatch):
    (tmp_path / "dp_probe_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("dp_probe_mod", lambda: seen.append(sys.modules["dp_probe_mod"].VALUE))
    assert seen == []
    import dp_probe_mod  # noqa: F401

    assert seen == [41]
    sys.modules.pop("dp_probe_mod")
    import dp_probe_mod  # noqa: F401,F811  (a second import: the hook is gone)

    assert seen == [41]
    after_import("dp_probe_mod", lambda: seen.append("now"))  # already imported: at once
    assert seen == [41, "now"]


def test_check_names_every_bad_key_not_only_the_first():
    problems = all_problems({"snapshot": {"intervall": 2, "background": "yes"}, "replication": {"factor": -1},
                             "log_level": "loud", "bogus": 1})
    keys = [p.split(": ")[1] for p in problems]
    assert keys == ["deadpool.bogus", "deadpool.snapshot.intervall", "deadpool.snapshot.background",
                    "deadpool.replication.factor", "deadpool.log_level"], problems
    assert all_problems({"snapshot": {"interval": 2}}) == []
    assert len(all_problems(None)) == 1  # the section itself is bad: one line, nothing to drop


@pytest.mark.parametrize("argv,rc,needle", [
    (["deadpool_ext.run"], 2, "usage: python -m deadpool_ext.run"),
    (["deadpool_ext.run", "-m"], 2, "-m needs a module name"),
    (["deadpool_ext.run", "/nonexistent/train.py"], 2, "script /nonexistent/train.py: no such file"),
    # a config with the section that no engine attached to: the job ran unprotected, exit 3
    (["deadpool_ext.run", "{tmp}/noop.py", "--deepspeed", "{tmp}/ds.json"], 3,
     '{tmp}/ds.json has a "deadpool" section, but no engine of this process attached'),
    (["deadpool_ext.cli", "check", "{tmp}/nope.json", "--json"], 2, "{tmp}/nope.json: cannot read it as JSON"),
], ids=["no-args", "no-module", "no-script", "nothing-attached", "check-no-file"])
def test_runner_bad_arguments_and_an_unattached_section_are_one_line(tmp_path, argv, rc, needle):
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 2, "deadpool": {}}))
    (tmp_path / "noop.py").write_text("print('did nothing')\n")
    r = subprocess.run([sys.executable, "-m", *(a.format(tmp=tmp_path) for a in argv)],
                       capture_output=True, text=True, timeout=120, env=_no_launcher_env(), cwd=REPO)
    assert_refusal(r, rc=rc, names=needle.format(tmp=tmp_path))


def test_runner_runs_a_script_as_main_with_its_argv_and_path(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import json, sys, os\nprint(json.dumps([sys.argv[1:], os.path.dirname(sys.path[0]) != '', "
                      "__name__]))\nsys.exit(7)\n")
    r = subprocess.run([sys.executable, "-m", "deadpool_ext.run", str(script), "a", "--b=c"], capture_output=True,
                       text=True, timeout=60, env=_no_launcher_env(), cwd=REPO)
    assert r.returncode == 7, r.stdout + r.stderr
    assert json.loads(r.stdout) == [["a", "--b=c"], True, "__main__"]


EXITS_WITH_GLOO_THREADS = """
import atexit, json, os, sys, threading, time
import torch, torch.distributed as dist
out = sys.argv[1]

def natives():  # registered first: runs last, after every other handler
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    json.dump(names, open(out + ".natives", "w"))

atexit.register(natives)
dist.init_process_group("gloo", store=dist.FileStore(out + ".store", 1), rank=0, world_size=1)
HELD = [dist.new_group([0])]  # a framework's reference: destroy_process_group drops only torch's registry entry
t = torch.ones(4)
dist.all_reduce(t, group=HELD[0])
atexit.register(dist.destroy_process_group)
fh = open(out + ".unclosed", "w")
fh.write("flushed")  # never closed by the script
threading.Thread(target=lambda: (time.sleep(0.3), open(out + ".thread", "w").write("joined"))).start()
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
sys.exit(5)
"""


def test_the_runner_exits_with_the_scripts_status_while_gloo_threads_still_run(tmp_path):
    """A script that trained to the end exits with its own status: the runner ends the process after the
    interpreter's own exit steps (non-daemon threads joined, atexit handlers run, files flushed) and before its
    finalization, where a gloo worker thread of a group a framework still holds would take the GIL of a dying
    interpreter and abort the process (run.exit_orderly). The gloo threads are alive when the last handler runs."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS_WITH_GLOO_THREADS)
    out = str(tmp_path / "out")
    r = subprocess.run([sys.executable, "-m", "deadpool_ext.run", str(script), out], capture_output=True, text=True,
                       timeout=120, env=_no_launcher_env(), cwd=REPO)
    assert r.returncode == 5, r.stdout + r.stderr
    done = {k: open(f"{out}.{k}").read() for k in ("unclosed", "thread", "atexit")}
    assert done == {"unclosed": "flushed", "thread": "joined", "atexit": "ran"}
    with open(out + ".natives") as fh:
        assert "pt_gloo_runloop" in json.load(fh)  # alive past every handler: finalization would have met them


def test_init_process_group_once_returns_when_a_group_exists(monkeypatch):
    import torch.distributed as dist

    from deadpool_ext import patches

    p = patches.get("torch_init_process_group_once")
    calls = []
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.setattr(c10d, "init_process_group", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(dist, "init_process_group", c10d.init_process_group)
    p.apply()
    try:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
        assert dist.init_process_group("gloo") is None and calls == []
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        dist.init_process_group(backend="gloo")
        assert calls == [{"backend": "gloo"}]  # no group yet: torch's own function
    finally:
        p.revert()


def test_trainer_resume_patch_skips_finished_epochs_and_fast_forwards(monkeypatch):
    from transformers import trainer as tm

    from deadpool_ext import patches

    seen = []

    def fake_prepare(self, max_steps, dl, resume_from_checkpoint):
        return "model", dl

    def fake_run_epoch(self, **kw):
        seen.append((kw["epoch"], kw["epochs_trained"], kw["steps_trained_in_current_epoch"],
                     kw["resume_from_checkpoint"]))

    monkeypatch.setattr(tm.Trainer, "_prepare_for_training", fake_prepare)
    monkeypatch.setattr(tm.Trainer, "_run_epoch", fake_run_epoch)
    rng_looked: list[str] = []
    monkeypatch.setattr(tm.Trainer, "_load_rng_state", lambda self, ckpt: rng_looked.append(ckpt))
    p = patches.get("transformers_trainer_resume")
    p._resume = None
    p.set_resume(lambda trainer: 7)
    p.apply()
    try:
        t = types.SimpleNamespace(state=types.SimpleNamespace(global_step=0),
                                  args=types.SimpleNamespace(gradient_accumulation_steps=2))
        assert tm.Trainer._prepare_for_training(t, 10, "dl", None) == ("model", "dl")
        assert t.state.global_step == 7
        for epoch in range(3):  # 3 update steps per epoch: step 7 = epoch 2, 1 step (2 batches) into it
            tm.Trainer._run_epoch(t, epoch=epoch, num_update_steps_per_epoch=3, epochs_trained=0,
                                  steps_trained_in_current_epoch=0, resume_from_checkpoint=None)
        tm.Trainer._run_epoch(t, epoch=3, num_update_steps_per_epoch=3, epochs_trained=0,
                              steps_trained_in_current_epoch=0, resume_from_checkpoint=None)
        assert seen == [(2, 2, 2, "<deadpool memory>"), (3, 0, 0, None)]
        # the resumed epoch's marker: no RNG file looked for (the RNG came back with the engine), no false warning
        tm.Trainer._load_rng_state(t, "<deadpool memory>")
        tm.Trainer._load_rng_state(t, "/ckpt/checkpoint-5")
        assert rng_looked == ["/ckpt/checkpoint-5"]
        # the Trainer's own resume_from_checkpoint path: the extension's resume is not called
        t2 = types.SimpleNamespace(state=types.SimpleNamespace(global_step=5), args=t.args)
        tm.Trainer._prepare_for_training(t2, 10, "dl", "/ckpt/checkpoint-5")
        assert t2.state.global_step == 5
    finally:
        p.revert()


# -- import-time probes never consume the lazy hook --------------------------------------------------------------

def _probes(name: str) -> None:
    """What frameworks run at their own import to see whether DeepSpeed is there, on ``name``: Accelerate's and
    transformers' ``_is_package_available`` (find_spec, then importlib.metadata), Lightning's ``package_available``
    and ``RequirementCache`` (importlib.metadata, then find_spec), a bare find_spec and a pkgutil lookup."""
    import importlib.metadata
    import importlib.util
    import pkgutil

    from accelerate.utils.imports import _is_package_available as accelerate_probe
    from lightning_utilities.core.imports import RequirementCache, package_available
    from transformers.utils.import_utils import _is_package_available as transformers_probe

    assert importlib.util.find_spec(name) is not None
    accelerate_probe(name)
    transformers_probe(name, return_version=False)
    package_available.cache_clear()
    assert package_available(name)
    bool(RequirementCache(name))
    assert importlib.metadata.version(name) == "1.0" and importlib.metadata.metadata(name)["Name"] == name
    assert any(m.name == name for m in pkgutil.iter_modules())


def test_probes_before_the_import_do_not_consume_the_hook(tmp_path, monkeypatch):
    (tmp_path / "dp_probed_mod.py").write_text("VALUE = 5\n")
    meta = tmp_path / "dp_probed_mod-1.0.dist-info"  # installed, as DeepSpeed is: the probes read its metadata
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: dp_probed_mod\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("dp_probed_mod", lambda: seen.append(sys.modules["dp_probed_mod"].VALUE))
    try:
        _probes("dp_probed_mod")
        _probes("dp_probed_mod")
        assert seen == [] and "dp_probed_mod" not in sys.modules and importhook.pending("dp_probed_mod")
        import dp_probed_mod  # noqa: F401

        assert seen == [5] and not importhook.pending("dp_probed_mod")
    finally:
        sys.modules.pop("dp_probed_mod", None)


def test_a_module_whose_code_raised_keeps_the_hook_for_the_next_import(tmp_path, monkeypatch):
    mod = tmp_path / "dp_flaky_mod.py"
    mod.write_text("raise ImportError('first time')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("dp_flaky_mod", lambda: seen.append(1))
    try:
        with pytest.raises(ImportError):
            import dp_flaky_mod  # noqa: F401
        assert seen == [] and importhook.pending("dp_flaky_mod")
        mod.write_text("VALUE = 1\n")
        import importlib

        importlib.invalidate_caches()
        import dp_flaky_mod  # noqa: F401,F811

        assert seen == [1]
    finally:
        sys.modules.pop("dp_flaky_mod", None)


def test_auto_hooks_deepspeed_after_the_frameworks_real_probes():
    """The real frameworks' imports and availability checks between ``import deadpool_ext.auto`` and DeepSpeed's
    import (Accelerate's at its import, transformers', Lightning's), then ``import deepspeed``: hooked."""
    code = ("import deadpool_ext.auto, accelerate, importlib.util\n"
            "from transformers.integrations.deepspeed import is_deepspeed_available\n"
            "from lightning_utilities.core.imports import RequirementCache\n"
            "assert is_deepspeed_available() and RequirementCache('deepspeed')\n"
            "assert importlib.util.find_spec('deepspeed')\n"
            "assert 'deepspeed' not in __import__('sys').modules\n"
            "import deepspeed\n"
            "from deadpool_ext.integrations import deepspeed_hook as h\n"
            "print(__import__('json').dumps([h.state().installed,\n"
            "                                h.original_initialize() is not deepspeed.initialize]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       env=_no_launcher_env(), cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == [True, True]  # hooked, and initialize replaced


# -- every form of config DeepSpeed takes ------------------------------------------------------------------------

def test_named_configs_follow_deepspeed_flags_and_accelerates_variable(tmp_path):
    on = tmp_path / "ds_config"  # no .json: named by its flag
    on.write_text(json.dumps({"train_batch_size": 2, "deadpool": {}}))
    acc = tmp_path / "acc.json"
    acc.write_text('{\n  // DeepSpeed reads HJSON: comments and all\n  train_batch_size: 2, "deadpool": {}\n}\n')
    env = {hook.ACCELERATE_CONFIG_ENV: str(acc)}
    assert [(p, w) for p, w, _ in hook.named_configs(["--deepspeed", str(on)], env)] == [
        (str(on), "on the command line"), (str(acc), "in ACCELERATE_DEEPSPEED_CONFIG_FILE")]
    assert [p for p, _ in hook.configs_with_section([f"--deepspeed_config={on}"], env)] == [
        str(on), f"{acc} (in ACCELERATE_DEEPSPEED_CONFIG_FILE)"]
    assert hook.named_configs(["--deepspeed", "--deepspeed_config", str(on)], {hook.ACCELERATE_CONFIG_ENV: "none"}) \
        == [(str(on), "on the command line", True)]  # the launcher's boolean --deepspeed, then the file
    assert hook.named_configs([str(acc)], {hook.ACCELERATE_CONFIG_ENV: str(acc)}) == [
        (str(acc), "on the command line", False)]  # named twice: once


def test_accelerate_launch_flag_reaches_the_workers_as_the_variable_the_runner_reads(tmp_path, monkeypatch):
    """``accelerate launch --deepspeed_config_file F``: Accelerate's own launch code (its parser, its validation,
    the environment it builds for the workers, as ``launch_command`` calls them) hands F to every worker as
    ``ACCELERATE_DEEPSPEED_CONFIG_FILE``, and the runner finds the section there with nothing on the script's
    command line. The real launch with that variable is ``test_accelerate_launch_config_from_the_environment_
    attaches`` (tests/integration/test_existing_jobs.py)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 4, "deadpool": {}}))
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no user's default Accelerate config
    monkeypatch.delenv(hook.ACCELERATE_CONFIG_ENV, raising=False)
    script_args = ["scripts/examples/accelerate_loop.py", "--steps", "2"]
    args = launch_command_parser().parse_args(["--use_deepspeed", "--deepspeed_config_file", str(cfg),
                                               "--num_processes", "2", "--num_machines", "1",
                                               "-m", "deadpool_ext.run", *script_args])
    args, defaults, _ = _validate_launch_command(args)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config) if defaults else ""
    _, worker_env = prepare_deepspeed_cmd_env(args)  # the command is for multi-machine launches only
    assert worker_env[hook.ACCELERATE_CONFIG_ENV] == str(cfg)
    assert [p for p, _ in hook.configs_with_section(script_args[1:], worker_env)] == [
        f"{cfg} (in ACCELERATE_DEEPSPEED_CONFIG_FILE)"]


def test_a_deepspeed_config_that_is_not_json_is_one_line_with_line_and_column(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{\n  "train_batch_size": 2,\n  "deadpool": {"snapshot": {"interval": 1}\n}\n')
    with pytest.raises(hook.ConfigError) as err:
        hook.configs_with_section(["--deepspeed", str(bad)])
    assert str(err.value).startswith(f"DeepSpeed config {bad} (on the command line): not valid JSON at line 5, "
                                     "column 1"), err.value
    with pytest.raises(hook.ConfigError, match="in ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        hook.configs_with_section([], {hook.ACCELERATE_CONFIG_ENV: str(bad)})
    assert hook.configs_with_section(["--data", str(bad)]) == []  # not a DeepSpeed flag: maybe a data file


def test_load_config_reads_what_deepspeed_reads(tmp_path):
    import base64

    doc = {"train_batch_size": 2, "deadpool": {}}
    path = tmp_path / "ds.hjson"
    path.write_text("# a comment\n{train_batch_size: 2, deadpool: {}}\n")
    assert hook.load_config(doc) is doc and hook.load_config(str(path)) == doc
    assert hook.load_config(base64.urlsafe_b64encode(json.dumps(doc).encode()).decode()) == doc
    assert hook.load_config("/nonexistent/ds.json") is None and hook.load_config(None) is None
    ns = argparse.Namespace(deepscale_config=str(path))  # DeepSpeed's deprecated name
    assert hook.config_of_call((ns,), {}) == str(path)


def test_a_section_only_the_built_engine_shows_is_attached_after_the_build(fresh_state, monkeypatch):
    from deadpool_ext.integrations import deepspeed as dsi

    registered = []
    monkeypatch.setattr(dsi, "register", lambda engine, section: registered.append(section))
    engine = types.SimpleNamespace(_config=types.SimpleNamespace(_param_dict={"deadpool": {"snapshot": {}}}),
                                   deadpool=None)
    out = hook._hooked(lambda *a, **k: (engine, None, None, None), (), {"config": object()})
    assert out[0] is engine and registered == [{"snapshot": {}}] and len(fresh_state.attached) == 1


def test_why_nothing_attached_names_the_cause():
    from deadpool_ext.run import why_unattached

    assert "never imported DeepSpeed" in why_unattached(hook.HookState(), False)
    assert "import deadpool_ext.auto" in why_unattached(hook.HookState(), True)
    assert "2 deepspeed.initialize call(s)" in why_unattached(hook.HookState(installed=True, plain=2), True)
    assert "built no engine" in why_unattached(hook.HookState(installed=True), True)


def test_a_process_that_never_restores_is_told_once_with_the_fix():
    from deadpool_ext.integrations.base import never_restored_lines

    fresh = never_restored_lines("step", [])
    assert len(fresh) == 1 and "never restores" in fresh[0] and "engine.deadpool.resume()" in fresh[0]
    after_restart = never_restored_lines("step", [6, 7])
    assert after_restart[0] == fresh[0]
    assert after_restart[1].startswith("deadpool_ext: snapshots of step 7 from an earlier attempt of this job exist")


def test_a_scripts_own_env_init_goes_to_the_launchers_store_and_every_other_call_is_torchs(monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from deadpool_ext import patches

    torch_calls, ours = [], []

    def torch_init(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                   group_name="", pg_options=None, device_id=None):
        torch_calls.append(backend)

    monkeypatch.setattr(c10d, "init_process_group", torch_init)
    monkeypatch.setattr(dist, "init_process_group", torch_init)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    p = patches.get("torch_init_process_group_launcher_store")
    p.set_init(lambda backend, timeout_s: ours.append((backend, timeout_s)), rank=1, world_size=2)
    p.apply()
    try:
        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=60))  # Accelerate's call
        dist.init_process_group("gloo", None, timedelta(seconds=9), 2, 1)  # DeepSpeed's: the launcher's rank, world
        dist.init_process_group()
        assert ours == [("gloo", 60.0), ("gloo", 9.0), (None, None)] and torch_calls == []
        dist.init_process_group("gloo", init_method="tcp://h:1", rank=1, world_size=2)  # its own rendezvous
        dist.init_process_group("gloo", rank=0, world_size=2)  # not this launcher's rank
        dist.init_process_group("gloo", store=object(), rank=1, world_size=2)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        dist.init_process_group("gloo")  # a group exists: torch's own (its error)
        assert torch_calls == ["gloo"] * 4 and len(ours) == 3
    finally:
        p.revert()


def test_the_worker_prefix_names_rank_and_node_once_known(monkeypatch):
    from deadpool_ext import logs

    spare = types.SimpleNamespace(rank=None, hot_swap=types.SimpleNamespace(role="spare", node="node2"))
    monkeypatch.setattr(logs, "worker_env", lambda: spare)
    monkeypatch.setattr(logs, "_last_rank", None)
    rank: list[int | None] = [None]
    monkeypatch.setattr(logs, "_current_rank", lambda: rank[0])
    assert logs.where() == "spare node2"  # waiting for an assignment
    rank[0] = 1
    assert logs.where() == "r1 node2"  # took rank 1's place
    rank[0] = None
    assert logs.where() == "r1 node2"  # its group torn down in a swap: the last rank known stands
    monkeypatch.setattr(logs, "worker_env", lambda: types.SimpleNamespace(rank=0, hot_swap=None))
    monkeypatch.setattr(logs, "_last_rank", None)
    assert logs.where() == "r?" and (rank.__setitem__(0, 0) or logs.where() == "r0")  # torchrun: no node


def test_a_workers_expected_teardown_before_a_restart_is_one_line():
    from deadpool_ext.run import restart_teardown_line

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:42368: Connection reset by peer.\n"
                        "This is typically caused by a remote worker hanging")
    line = restart_teardown_line(lost, 0, 1, True, restores=True)
    assert line and "\n" not in line and "restart 1 of 1" in line and "Connection reset by peer" in line
    for restores in (True, False):
        assert restart_teardown_line(lost, 1, 1, True, restores=restores) is None  # no restart left: the traceback
        assert restart_teardown_line(lost, 0, None, True, restores=restores) is None  # not under torchrun
        assert restart_teardown_line(lost, 0, 1, False, restores=restores) is None  # no runtime: not expected
        assert restart_teardown_line(ValueError("Connection reset by peer"), 0, 1, True, restores=restores) is None
        assert restart_teardown_line(RuntimeError("CUDA out of memory"), 0, 1, True, restores=restores) is None


def test_a_survivor_never_promises_a_restore_that_will_not_happen():
    """A script that never ran a restore path (no resume(), resilient_steps, Trainer or Lightning, no load routed to
    memory) is restarted by torchrun all the same, but trains again from step 0: the survivor's line says so and
    names the fix instead of promising a restore from memory."""
    from deadpool_ext.integrations.base import RESUME_FIX
    from deadpool_ext.run import restart_teardown_line

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection closed by peer [127.0.0.1]:42368")
    promised = restart_teardown_line(lost, 0, 2, True, restores=True)
    honest = restart_teardown_line(lost, 0, 2, True, restores=False)
    assert promised is not None and promised.endswith("which restores from memory")
    assert honest is not None and "restores from memory" not in honest.replace("never restores from memory", "")
    assert "from step 0" in honest and honest.endswith(RESUME_FIX) and "\n" not in honest


def test_what_marks_a_runtime_as_restoring_at_a_restart():
    """``ResilientRuntime.restoring_total`` (what the runner's line decides from) counts a runtime once, when a
    restore path marks it (``resume()``, or a framework's load routed to memory setting ``_resume_called``), and
    only with ``recovery.restore_on_start`` (without it a restart restores nothing)."""
    from deadpool_ext.config import DeadpoolConfig
    from deadpool_ext.integrations.base import ResilientRuntime

    class Bare(ResilientRuntime):  # the property alone: no snapshot manager, no process group
        def __init__(self, config):
            self.config = config
            self._resume_called = False

        step_counter = _release = _rebuild = _runtime_of = None  # type: ignore[assignment]

    before = ResilientRuntime.restoring_total
    try:
        rt = Bare(DeadpoolConfig.from_dict({}))
        assert ResilientRuntime.restoring_total == before and not rt._resume_called
        rt._resume_called = True
        rt._resume_called = True  # once per runtime
        assert ResilientRuntime.restoring_total == before + 1 and rt._resume_called
        off = Bare(DeadpoolConfig.from_dict({"recovery": {"restore_on_start": False}}))
        off._resume_called = True
        assert ResilientRuntime.restoring_total == before + 1
    finally:
        ResilientRuntime.restoring_total = before


def test_the_launchers_final_line_names_the_real_cause():
    from deadpool_ext.launcher.final import stop_line

    lost = stop_line("no spare node left to replace node1", "stop", {"node1.0": -9, "node1.1": None})
    assert "out of spares" in lost and "--load" in lost and "--spare-nodes" in lost
    own = stop_line("no spare node left to replace node1", "stop", {"node1.0": 1, "node1.1": -9})
    assert own.startswith("worker(s) node1.0 (exit status 1) exited on its own") and "--spare-nodes" not in own
    assert "refused its configuration" in stop_line("x", "stop", {"node0.0": 2})
    assert "no engine attached to" in stop_line("x", "stop", {"node0.0": 3})
    assert all("\n" not in line for line in (lost, own))


def test_the_stopped_events_cause_is_the_final_lines():
    """The ``stopped`` event's ``cause`` (final.stop_cause): the decision behind the final line, from the exits."""
    from deadpool_ext.launcher.final import stop_cause

    assert stop_cause({"node1.0": -9, "node1.1": None}) == "out_of_spares"  # fenced or lost: not the script's doing
    assert stop_cause({}) == "out_of_spares"
    assert stop_cause({"node1.0": 1, "node1.1": -9}) == "exited_on_its_own"
    assert stop_cause({"node0.0": 2}) == "refused" and stop_cause({"node0.0": 2, "node0.1": 2}) == "refused"
    assert stop_cause({"node0.0": 3}) == "unattached"
    assert stop_cause({"node0.0": 2, "node0.1": 3}) == "exited_on_its_own"  # mixed: none of the runner's two
    assert stop_cause({"node0.0": 4}) == "unprotected_loop"  # a peer lost mid-collective, outside a redoable step
    assert stop_cause({"node0.0": 4, "node0.1": -15}) == "unprotected_loop"
    assert stop_cause({"node0.0": 4, "node0.1": 1}) == "exited_on_its_own"  # one of them failed by itself


def test_a_peer_lost_mid_collective_is_never_called_the_scripts_own_error():
    """A deadpool-run worker whose script ended on a failure the launcher explains (it published the next
    generation: a peer was lost) stops with LOST_PEER_EXIT and a line naming what the loop needs; the launcher's
    final line for that exit is not "the script's own error" (final.stop_line)."""
    from deadpool_ext.launcher.final import LOST_PEER_EXIT, UNPROTECTED_FIX, stop_cause, stop_line
    from deadpool_ext.run import unprotected_loss_line

    reset = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:42368: Connection reset by peer"
    line = unprotected_loss_line("RuntimeError", reset, "train.py:40 main", generation=1, published=2, stop=None,
                                 stopped_by_notice=False)
    assert line is not None and "\n" not in line and line.endswith(UNPROTECTED_FIX)
    # by cause, never by the exception's words: the generation still the newest is the script's own failure
    assert unprotected_loss_line("RuntimeError", reset, None, generation=1, published=1, stop=None,
                                 stopped_by_notice=False) is None
    assert unprotected_loss_line("RuntimeError", reset, None, generation=1, published=None, stop=None,
                                 stopped_by_notice=False) is None
    # the launcher stopped the job: its own message stands
    assert unprotected_loss_line("RuntimeError", reset, None, generation=1, published=2, stop="out of spares",
                                 stopped_by_notice=False) is None
    # a step the launcher's notice stopped (GenerationLost, no gloo words) is a lost peer all the same
    assert unprotected_loss_line("GenerationLost", "generation 1 was abandoned", None, generation=1, published=2,
                                 stop=None, stopped_by_notice=True) is not None
    said = stop_line("no spare node left to replace node0", "fail", {"node0.0": LOST_PEER_EXIT})
    assert stop_cause({"node0.0": LOST_PEER_EXIT}) == "unprotected_loop" and UNPROTECTED_FIX in said
    assert "script's own error" not in said and "\n" not in said


def test_the_script_frame_names_where_the_script_called_what_failed(tmp_path):
    from deadpool_ext.run import script_frame

    script = tmp_path / "train.py"
    script.write_text("def main():\n    raise RuntimeError('Connection reset by peer')\n")
    ns: dict = {}
    exec(compile(script.read_text(), str(script), "exec"), ns)
    try:
        ns["main"]()
    except RuntimeError as exc:
        assert script_frame(exc, str(script)) == "train.py:2 main"
        assert script_frame(exc, None) is None and script_frame(exc, str(tmp_path / "other.py")) is None


def test_check_says_which_tiers_depend_on_the_launch_layout():
    from deadpool_ext.commands.check import _turns_on
    from deadpool_ext.config import DeadpoolConfig

    minimal = _turns_on(DeadpoolConfig.from_dict({"snapshot": {"interval": 1}, "replication": {"factor": 1}}))
    tier2 = [ln for ln in minimal if ln.startswith("tier 2")]
    assert tier2 and "depends on the launch layout" in tier2[0] and "tier 2 is off" in tier2[0], minimal
    assert any("not the loss of the node" in ln for ln in minimal if ln.startswith("tier 1"))
    assert any("depends on the launch" in ln for ln in minimal if ln.startswith("hot-swap"))


def test_the_compiled_op_cache_has_a_per_user_default_the_user_can_override():
    assert hook.extensions_dir_default({"HOME": "/home/u"}) == "/home/u/.cache/deadpool/torch_extensions"
    assert hook.extensions_dir_default({"HOME": "/home/u", "XDG_CACHE_HOME": "/c"}) == "/c/deadpool/torch_extensions"
    unset = {"HOME": "/home/u"}
    hook.default_extensions_dir(unset)  # what the runner and deadpool_ext.auto call with os.environ
    assert unset["TORCH_EXTENSIONS_DIR"] == "/home/u/.cache/deadpool/torch_extensions"
    mine = {"TORCH_EXTENSIONS_DIR": "/mine", "HOME": "/home/u"}
    hook.default_extensions_dir(mine)
    assert mine["TORCH_EXTENSIONS_DIR"] == "/mine"  # the user's choice stands


def test_the_deepspeed_launchers_local_rank_goes_to_the_script():
    from deadpool_ext.run import launcher_args_after_script

    assert launcher_args_after_script(["--local_rank=1", "train.py", "--deepspeed_config", "ds.json"]) == [
        "train.py", "--local_rank=1", "--deepspeed_config", "ds.json"]
    assert launcher_args_after_script(["--local_rank=0", "-m", "pkg.train", "--x"]) == ["-m", "pkg.train",
                                                                                        "--local_rank=0", "--x"]
    assert launcher_args_after_script(["train.py", "--local_rank=0"]) == ["train.py", "--local_rank=0"]
