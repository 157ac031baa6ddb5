"""Run a training script unchanged, with the extension attached: ``python -m deadpool_ext.run train.py ARGS``.

Works after any launcher (``torchrun``, the ``deepspeed`` launcher, ``srun``, ``deadpool-run``, which uses it
for every worker)::

    torchrun --nproc-per-node 2 -m deadpool_ext.run train.py --deepspeed ds_config.json
    deadpool-run --nnodes 2 --spare-nodes 1 train.py --deepspeed ds_config.json

Before the script's first line runs, in this order:

1. configs named on the command line (``x.json``, ``--flag=x.json``, the value of ``--deepspeed`` /
   ``--deepspeed_config`` whatever its name) or by ``accelerate launch`` (``ACCELERATE_DEEPSPEED_CONFIG_FILE``) are
   read for a ``"deadpool"`` section (one that is not JSON, nor DeepSpeed's HJSON: file, line and column, exit 2):
   the section's ``log_level`` and collective timeout apply from here on, and a DeepSpeed engine later built
   *without* the section is an error naming why (``hook.NotAttachedError``), never an unprotected job;
2. the hook on ``deepspeed.initialize`` is installed (``integrations/deepspeed_hook.py``): at once when a
   DeepSpeed config with a section is on the command line, otherwise when the script imports DeepSpeed (a job
   without DeepSpeed pays nothing);
3. under a launcher (``RANK``/``WORLD_SIZE`` set, or deadpool-run) with a section on the command line, or
   always under deadpool-run: the default process group, built by
   :func:`deadpool_ext.distributed.init_distributed` (attempt-prefixed store; a deadpool-run spare waits here
   for its assignment, after its warm parent forked it: ``rebuild/warm.py``), and ``init_process_group`` made a
   logged no-op for scripts that call it anyway (``patches/torch_init_process_group_once.py``);
4. the script runs as ``__main__`` (``sys.argv`` and ``sys.path[0]`` as ``python train.py ARGS`` would set them).

After it returns: if a section was on the command line but no engine attached the extension, the run ends with
exit status 3 and a line saying so. Bad arguments: one line, exit status 2.
"""
from __future__ import annotations

import logging
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

log = logging.getLogger("deadpool_ext")

NOT_ATTACHED_EXIT = 3
USAGE = "usage: python -m deadpool_ext.run SCRIPT.py [ARGS...]  |  python -m deadpool_ext.run -m MODULE [ARGS...]"


def _section_configs(argv: Sequence[str]) -> tuple[list[str], list[str], dict[str, Any]]:
    """(DeepSpeed configs with a section, every config with a section, the first section found): named on the
    command line or by ``accelerate launch`` (``ACCELERATE_DEEPSPEED_CONFIG_FILE``, from its config YAML or
    ``--deepspeed_config_file``). Raises ``ConfigError`` (one line) for a DeepSpeed config that is not JSON."""
    from .integrations.deepspeed_hook import configs_with_section

    found = configs_with_section(argv, dict(os.environ))
    # A DeepSpeed config has other keys; Megatron's --deadpool-config holds only the section.
    deepspeed_like = [path for path, doc in found if set(doc) - {"deadpool"}]
    return deepspeed_like, [path for path, _ in found], (found[0][1]["deadpool"] if found else {})


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    import time

    from .rebuild.context import context

    context().spare.times.setdefault("started_at", time.time())  # a spare's prologue starts here (its timeline)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n")[0], file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    args = launcher_args_after_script(args)
    module = None
    if args[0] == "-m":
        if len(args) < 2:
            print(f"deadpool_ext.run: -m needs a module name\n{USAGE}", file=sys.stderr)
            return 2
        module, script_args = args[1], args[2:]
    else:
        from .launcher.args import _script_error

        why = _script_error(args[0])
        if why is not None:
            print(f"deadpool_ext.run: {why}", file=sys.stderr)
            return 2
        script_args = args[1:]
    from .config import ConfigError, DeadpoolConfig
    from .logs import configure_logging

    try:
        ds_configs, configs, section = _section_configs(script_args)
        cfg = DeadpoolConfig.from_dict(section) if configs else None
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    configure_logging(cfg.log_level if cfg is not None else "info")
    from .integrations import deepspeed_hook as hook

    hook.default_extensions_dir(os.environ)

    if ds_configs:
        hook.expect_sections(ds_configs)
        import deadpool_ext.integrations.deepspeed  # noqa: F401  (registers the spare warm-up and teardown)
    try:
        hook.install(lazy=not ds_configs)
    except Exception as exc:  # UnsupportedVersionError: one line, the job runs without the hook only if asked to
        if ds_configs:
            print(f"deadpool_ext.run: {exc}", file=sys.stderr)
            return 2
        log.warning("deadpool_ext.run: no hook on deepspeed.initialize: %s", exc)
    from .integrations import lightning, transformers_trainer

    transformers_trainer.install(lazy=True)
    lightning.install(lazy=True)
    from .launcher.contract import worker_env

    env = worker_env()
    if env.hot_swap is not None or (configs and not env.missing_for_init()):
        from .distributed import init_distributed
        from .rebuild.fastpaths import before_script

        # swappable groups for DeepSpeed jobs (Megatron-Core rebuilds: docs/megatron.md); no config visible (a dict
        # built in code): the section's defaults, which the job's attach confirms to spares (rebuild/fastpaths.py)
        fast = before_script(ds_configs, configs, cfg)
        hs = env.hot_swap
        if hs is not None and hs.role == "spare" and fast.in_place and (fast.build_ahead or not fast.known):
            from .rebuild import warm

            # a spare that may build ahead: a start again forks from here, its imports done (rebuild/warm.py)
            warm.hold(hs.worker_id, args[0] if module is None else None, module, warm_up=_deepspeed_warm_up)
        init_distributed(timeout_s=cfg.hot_swap.collective_timeout_s if cfg is not None else None, fast=fast)
        from . import patches  # type: ignore[attr-defined]

        patches.get("torch_init_process_group_once").apply()
        if fast.in_place:  # a spare's solo set-up: object broadcasts keep the caller's objects (patch docstring)
            from .rebuild import swap

            solo = patches.get("torch_solo_broadcast_object")
            solo.set_local(lambda: swap.mode() == "solo")
            solo.apply()
    elif env.rank is not None and env.world_size is not None and not env.missing_for_init():
        _group_on_the_launchers_store_when_the_script_builds_it(env.rank, env.world_size)
    from .rebuild.spare import start_up_failure_said

    with start_up_failure_said():  # a spare whose build ahead fails says why (rebuild/spare.py)
        code = _run_script(module, args[0] if module is None else None, script_args,
                           verdict_wait_s=cfg.hot_swap.assignment_timeout_s if cfg is not None else None)
    from .preempt.worker import disarm

    disarm()  # the script returned: a SIGTERM from here on (the launcher ending the job) ends the process at once
    if code == 0:
        # The script finished: under deadpool-run, say so before the interpreter shuts down (tearing down a
        # framework's groups and threads can take seconds without heartbeats, which the launcher would otherwise
        # take for a hang and fence a process that finished).
        from .rebuild.context import context

        current = context().membership
        if current is not None:
            current.mark_done()
    if code == 0 and configs:
        from .integrations.base import ResilientRuntime

        if ResilientRuntime.attached_total == 0:
            print(f"deadpool_ext.run: {', '.join(configs)} has a \"deadpool\" section, but no engine of this "
                  f"process attached the extension ({why_unattached(hook.state(), 'deepspeed' in sys.modules)}): "
                  "the job ran unprotected", file=sys.stderr)
            return NOT_ATTACHED_EXIT
    return code


def _deepspeed_warm_up() -> list[str]:
    """A spare's warm parent, once it imported the script's frameworks: what ``deepspeed.initialize`` does lazily in
    every process, done once for every child (``rebuild/warm.py``); what it did."""
    if "deepspeed" not in sys.modules:
        return []
    from .integrations.deepspeed.warmup import import_lazy_modules, preload_comm_op

    import_lazy_modules()
    return ["deepspeed's lazy modules"] + (["deepspeed's comm op"] if preload_comm_op() is not None else [])


def _group_on_the_launchers_store_when_the_script_builds_it(rank: int, world_size: int) -> None:
    """No section seen before the start (a config dict built in code may still attach at deepspeed.initialize):
    the script's own env:// ``init_process_group`` builds the group as the runner would have, so a torchrun restart
    of such a job reconnects (``patches/torch_init_process_group_launcher_store.py``)."""
    from datetime import timedelta

    from . import patches  # type: ignore[attr-defined]

    def init(backend: str | None, timeout_s: float | None) -> None:
        from torch.distributed.constants import default_pg_timeout

        from .distributed import init_distributed

        default = default_pg_timeout.total_seconds() if isinstance(default_pg_timeout, timedelta) else 1800.0
        init_distributed(backend, default if timeout_s is None else timeout_s)

    p = patches.get("torch_init_process_group_launcher_store")
    try:
        p.set_init(init, rank=rank, world_size=world_size)
        p.apply()
    except patches.UnsupportedVersionError as exc:  # torch's own group then: a restart may not reconnect
        log.warning("deadpool_ext.run: %s", exc)


def launcher_args_after_script(args: list[str]) -> list[str]:
    """The ``deepspeed`` launcher started with ``--module deadpool_ext.run`` puts its ``--local_rank=N`` before
    everything else (``python -m deadpool_ext.run --local_rank=1 train.py ...``); the script expects it as its own
    first argument, as the launcher passes it to a script started directly (pure)."""
    lead = []
    while args and args[0].startswith(("--local_rank=", "--local-rank=")):
        lead.append(args.pop(0))
    if not lead or not args:
        return lead + args
    split = 2 if args[0] == "-m" else 1
    return args[:split] + lead + args[split:]


def why_unattached(state: Any, deepspeed_imported: bool) -> str:
    """Why a job whose config has a section ended with no engine attached (pure: the hook's state and whether
    DeepSpeed was ever imported)."""
    if not deepspeed_imported:
        return "the script never imported DeepSpeed, so no DeepSpeed engine was built"
    if not state.installed:
        return ("DeepSpeed was imported but the hook on deepspeed.initialize was never installed (something imported "
                "DeepSpeed around the import system); add `import deadpool_ext.auto` as the script's first line")
    if state.plain:
        return f"{state.plain} deepspeed.initialize call(s) carried a config without the section"
    return "deepspeed.initialize never ran (the script built no engine), and no runtime was registered"


def _run_script(module: str | None, path: str | None, script_args: list[str],
                verdict_wait_s: float | None = None) -> int:
    from .config import ConfigError

    try:
        if module is not None:
            sys.argv = [module, *script_args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            assert path is not None
            sys.argv = [path, *script_args]
            sys.path[0] = os.path.dirname(os.path.abspath(path))
            runpy.run_path(path, run_name="__main__")
    except ConfigError as exc:  # a bad section, or an engine built without the section (NotAttachedError)
        from .recovery.timeline import write_refusal

        print(str(exc), file=sys.stderr)
        write_refusal(exc, exit_status=2)
        return 2
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        print(exc.code, file=sys.stderr)
        return 1
    except Exception as exc:
        from .integrations.base import ResilientRuntime
        from .launcher.contract import worker_env

        env = worker_env()
        if env.hot_swap is not None:  # deadpool-run: a peer lost outside a step the extension can redo
            code = _stopped_by_a_lost_peer(exc, path, verdict_wait_s)
            if code is None:
                raise
            return code
        restores = ResilientRuntime.restoring_total > 0
        line = restart_teardown_line(exc, env.restart_count, env.max_restarts, ResilientRuntime.attached_total > 0,
                                     restores=restores)
        if line is None:
            raise
        from .logs import where
        from .recovery.timeline import write_event

        print(f"deadpool_ext.run [{where()}]: {line}", file=sys.stderr, flush=True)
        write_event(event="stopped_for_restart", restart=env.restart_count + 1, max_restarts=env.max_restarts,
                    error=type(exc).__name__, restores=restores)
        return 1
    return 0


def restart_teardown_line(exc: BaseException, restart_count: int, max_restarts: int | None,
                          attached: bool, *, restores: bool) -> str | None:
    """The one line a worker prints instead of a traceback when its collective failed because a peer died and
    torchrun restarts the job next (pure). ``restores``: a restore path ran in this process (``resume()``, or a
    framework's load routed to memory), so the restarted job restores from memory; without one the line says
    that the restarted job trains again from step 0, and the fix. None: not that case (the traceback stands)."""
    from .rebuild.cause import lost_peer_text

    text = " ".join(str(exc).split())
    if not attached or max_restarts is None or restart_count >= max_restarts:
        return None
    if not isinstance(exc, RuntimeError) or not lost_peer_text(text):
        return None
    head = (f"a peer process was lost ({type(exc).__name__}: {text[:160]}); this worker stops so that torchrun "
            f"restarts the job (restart {restart_count + 1} of {max_restarts})")
    if restores:
        return f"{head}, which restores from memory"
    from .integrations.base import RESUME_FIX

    return (f"{head}; this script never restores from memory (nothing called resume(): no resilient_steps, HF "
            f"Trainer or Lightning path), so the restarted job trains again from step 0. {RESUME_FIX}")


def _stopped_by_a_lost_peer(exc: BaseException, path: str | None, verdict_wait_s: float | None) -> int | None:
    """Under deadpool-run, an exception that ended the script: when the launcher ended the generation it ran in (a
    peer was lost; asked as the recovery driver asks, after reporting the failed collective), one line naming where
    it failed and what the loop needs, and :data:`~deadpool_ext.launcher.final.LOST_PEER_EXIT`, which the
    launcher's final line reads (``launcher/final.py``). None: not a lost peer (the traceback stands)."""
    from .config import HotSwapConfig
    from .launcher.final import LOST_PEER_EXIT
    from .rebuild import notice
    from .rebuild.cause import lost_peer_text
    from .rebuild.context import context
    from .rebuild.recover import report_collective_failure

    m = context().membership
    if m is None or m.assignment is None:
        return None
    gen = m.assignment.generation
    published, stop = m.verdict(gen, 0.0)
    hint = isinstance(exc, notice.GenerationLost) or lost_peer_text(str(exc))
    if hint and stop is None and (published is None or published <= gen):  # the launcher may not know yet
        report_collective_failure(m, gen, exc)
        published, stop = m.verdict(gen, HotSwapConfig().assignment_timeout_s if verdict_wait_s is None
                                    else verdict_wait_s)
    at = script_frame(exc, path)
    line = unprotected_loss_line(type(exc).__name__, str(exc), at, generation=gen, published=published, stop=stop,
                                 stopped_by_notice=notice.stopped(gen))
    if line is None:
        return None
    from .logs import where
    from .recovery.timeline import write_event

    print(f"deadpool_ext.run [{where()}]: {line}", file=sys.stderr, flush=True)
    write_event(event="unprotected_loss", generation=gen, published=published, error=type(exc).__name__, at=at,
                exit_status=LOST_PEER_EXIT)
    return LOST_PEER_EXIT


def unprotected_loss_line(error_type: str, error: str, at: str | None, *, generation: int, published: int | None,
                          stop: str | None, stopped_by_notice: bool) -> str | None:
    """The one line a deadpool-run worker prints when its script ended on a failure whose cause is a lost peer (the
    launcher published a generation after ``generation``: ``rebuild/cause.py``), outside a step the extension can
    redo (pure). None: the launcher stopped the job (its message stands), or the generation is still the newest
    (the failure is the script's own: its traceback stands)."""
    from .launcher.final import UNPROTECTED_FIX
    from .rebuild.cause import failure_cause

    if stop is not None or failure_cause(generation, published, stopped_by_notice) is None:
        return None
    text = " ".join(error.split())[:160]
    where = f" at {at}" if at else ""
    return (f"a peer was lost mid-collective in generation {generation} ({error_type}: {text}){where}, and the loop "
            f"is not protected against a lost peer, so this worker stops; {UNPROTECTED_FIX}")


def script_frame(exc: BaseException, path: str | None) -> str | None:
    """``file:line function`` of the innermost frame of the script ``path`` in ``exc``'s traceback (where the
    script called what failed), else None."""
    import traceback

    if path is None:
        return None
    script = os.path.abspath(path)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == script]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name}" if frames else None


def exit_orderly(code: int) -> NoReturn:
    """End the process with ``code`` the way the interpreter would, less its finalization: the script's
    non-daemon threads joined, its objects in reference cycles collected (files flushed and closed), every
    ``atexit`` handler run (the runtimes closed, their snapshot workers joined, the process groups destroyed,
    logging flushed), every open file flushed; then ``os._exit``. Why: process groups a framework still holds
    (DeepSpeed's, Accelerate's: destroy_process_group drops only torch's registry entries) keep their gloo worker
    threads until finalization, and a worker that releases a finished collective's tensors then takes the GIL of
    a dying interpreter: the thread is ended inside C++ code and the process aborts ("terminate called without an
    active exception", SIGABRT) after the job trained to the end (seen once in three HF Trainer runs). Nothing
    runs after the handlers but C++ static destructors, which this skips."""
    import atexit
    import gc
    import threading

    main_thread = threading.main_thread()
    for t in threading.enumerate():
        if t is not main_thread and not t.daemon:
            t.join()  # as the interpreter's shutdown does, before the handlers
    gc.collect()
    atexit._run_exitfuncs()
    _flush_open_files()
    os._exit(code)


def _flush_open_files() -> None:
    """Flush every open file object still alive (a script's handle referenced from a callback, a module global):
    finalization would have flushed them as it freed them; standard streams last."""
    import gc
    import io

    for obj in gc.get_objects():
        try:
            if isinstance(obj, io.IOBase) and obj not in (sys.stdout, sys.stderr) and not obj.closed \
                    and obj.writable():
                obj.flush()
        except Exception:  # a broken pipe, a closed descriptor: what it held cannot be written any more
            continue
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


if __name__ == "__main__":
    exit_orderly(main())
