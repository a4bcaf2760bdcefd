"""Start a mesh of processes on this machine, or join the one ``torchrun`` started; fail fast.

``spawn(fn, n, *args)`` runs ``fn(rank, n, init_method, *args)`` in ``n`` fresh processes and
returns their exit codes; ``init_group`` joins torch.distributed (gloo on CPU, NCCL when each rank
has a GPU). Neither lets a failure turn into a hang:

* The launcher hosts the mesh's key-value store (a c10d ``TCPStore``, as torchrun's agent does),
  watches its children and, when one exits non-zero or is killed, records how in the store,
  gives the others ``grace`` seconds to stop by themselves, then terminates them.
* Every rank runs a ``Watchdog`` thread (``nvtp.execute.watchdog``; started by ``init_group``, or
  by ``nvtp.jit`` / ``nvtp.ShardingTransform`` in a process group the caller made): it beats a heartbeat into the store every
  ``HEARTBEAT_S`` and stops the rank, naming the failed rank, when a peer recorded a failure,
  when a peer's process on this machine is gone, when a peer's heartbeat has been silent for
  ``timeout`` seconds, or when this rank has waited ``timeout`` seconds in one collective
  (naming the ranks that never reached it).
* ``run_rank`` wraps a rank's work: an exception prints ``nvtp: rank r failed: ...``, is
  recorded in the store for the others, and gives exit code 3 (bad input) or 4; a collective
  that fails because a peer died prints ``nvtp: rank r stopping: rank k failed: ...`` instead.

So a rank that raises or is killed stops every other rank within about a second, and a rank that
hangs stops them within ``timeout`` seconds plus a second (docs/faults.md).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing.connection
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import reduction

from nvtp.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, exit_code_for
from nvtp.execute.watchdog import (HEARTBEAT_S, PeerFailure, Watchdog, _record, describe_exit,  # noqa: F401 - re-exported
                                   looks_like_communication, recorded_failures, say)

# What the fork server imports once, so that a rank starts in a fraction of a second instead of importing
# torch, Thunder and nvtp again (about 10 s a rank on 2 cores; each rank of every launch paid it). Importing
# Thunder counts CUDA devices, after which a forked process cannot use CUDA: it is preloaded only where no
# GPU is (a rank on a GPU imports it itself).
PRELOAD = ("torch", "torch.distributed", "nvtp.execute.reference")
PRELOAD_WITHOUT_GPU = ("thunder", "nvtp.driver")
GRACE_S = 5.0  # how long the launcher lets the other ranks stop by themselves after a failure
JOIN_TIMEOUT_S = 120.0  # how long a rank waits for the others to join (importing torch and tracing take a while)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def init_group(rank: int, world: int, init_method: str | None, timeout_s: float = 60.0) -> None:
    """Join the default process group (unless the caller already did) and start this rank's
    watchdog. ``init_method``: ``nvtp://host:port`` (the store ``spawn`` hosts), ``tcp://...``,
    or None for torchrun's environment. ``timeout_s`` bounds every wait on a silent peer (the
    watchdog enforces it; joining waits up to ``max(timeout_s, JOIN_TIMEOUT_S)``, as the group's
    own timeout, for ranks that start slowly)."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        group_timeout = max(timeout_s, JOIN_TIMEOUT_S)
        kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=group_timeout)}
        with _quiet_stdout():  # gloo prints "[Gloo] Rank r is connected to ..." for every rank
            if init_method is None:
                dist.init_process_group(**kwargs)  # torchrun's environment
            elif init_method.startswith("nvtp://"):
                host, port = _address(init_method)
                store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=group_timeout))
                dist.init_process_group(store=store, rank=rank, world_size=world, **kwargs)
            else:
                dist.init_process_group(init_method=init_method, rank=rank, world_size=world, **kwargs)
    if dist.get_world_size() > 1:
        start_watchdog(timeout_s, init_method)


def _address(url: str) -> tuple[str, int]:
    host, _, port = url.split("://", 1)[1].rpartition(":")
    return host, int(port)


@contextlib.contextmanager
def _quiet_stdout():
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


# ---------------------------------------------------------------------------------------------
# the watchdog of this process


_WATCHDOG: Watchdog | None = None

def start_watchdog(timeout_s: float, init_method: str | None = None) -> Watchdog | None:
    """Start this rank's watchdog in the default process group (once per process: a later call
    shortens its timeout to ``timeout_s`` if that is shorter, so the shortest timeout asked for
    holds); None when the group's store is not a TCP store nvtp can reach."""
    global _WATCHDOG
    if _WATCHDOG is not None and not _WATCHDOG._stop.is_set():
        _WATCHDOG.timeout = min(_WATCHDOG.timeout, timeout_s)
        return _WATCHDOG
    rank, world = dist.get_rank(), dist.get_world_size()
    address = _store_address(init_method)
    if address is None:
        return None
    host, port, hosts_store, desc = address
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=min(timeout_s, 30.0)))
    _WATCHDOG = Watchdog(store, rank, world, timeout_s, hosts_store=hosts_store and rank == 0, store_desc=desc).start()
    if hosts_store and rank == 0:  # the group's store serves the peers' watchdogs until they are done, even
        _WATCHDOG.hosted = dist.distributed_c10d._get_default_store()  # after a destroy_process_group (the peers'd see a broken pipe)
    _install_exit_hooks()
    return _WATCHDOG


def _store_address(init_method: str | None) -> tuple[str, int, bool, str] | None:
    """(host, port, whether rank 0 hosts it, description) of the default group's TCP store."""
    if init_method and init_method.startswith("nvtp://"):
        host, port = _address(init_method)
        return host, port, False, f"the launcher's, {host}:{port}"
    if init_method is None and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ and "RANK" in os.environ:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        return host, port, not agent, (f"torchrun's, {host}:{port}" if agent else f"rank 0's, {host}:{port}")
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port, True, f"rank 0's, {store.host}:{store.port}"
    return None


@functools.cache  # once per process
def _install_exit_hooks() -> None:
    """For programs that call nvtp.jit themselves: an uncaught exception is recorded (or, if a
    peer's failure caused it, the peer is named); a normal exit says this rank is done."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        wd = _WATCHDOG
        if wd is not None and isinstance(value, Exception):
            wd.communication_failed(value)  # a transport error because a peer failed: stop naming the peer, no traceback
        previous(kind, value, tb)
        if wd is not None and not wd._exiting and isinstance(value, Exception):
            code = _report(wd.rank, value, wd, print_traceback=False)
            wd._stop.set()  # this process is ending: its watchdog has nothing left to watch
            # The program's own atexit hooks run, then the process ends: torch's teardown of a process group whose
            # peers or store are gone can wait many seconds (8.5 s seen with gloo), as run_rank's failed ranks avoid too.
            with contextlib.suppress(Exception):
                atexit._run_exitfuncs()
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    sys.excepthook = hook

    def at_exit():
        wd = _WATCHDOG
        if wd is not None:
            wd.finish()

    atexit.register(at_exit)


# ---------------------------------------------------------------------------------------------
# a rank's work


def describe_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if "Timed out waiting" in str(e):
        return f"a collective timed out ({text})"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _report(rank: int, e: BaseException, wd: Watchdog | None, print_traceback: bool) -> int:
    """Print and record ``e``; returns its exit code. If it came from a peer's failure, name the
    peer and exit at once."""
    if wd is not None and looks_like_communication(e):
        found = wd.diagnose(wait=2.0, timed_out="Timed out" in str(e) or "timeout" in str(e).lower())
        if found is not None:
            wd.abort(found)
    message = describe_error(e)
    code = exit_code_for(e)
    bad_input = code == EXIT_BAD_INPUT
    if print_traceback and not bad_input and os.environ.get("NVTP_DEBUG"):
        traceback.print_exception(e)
    print(f"nvtp: rank {rank} failed: {message}" + ("" if bad_input or os.environ.get("NVTP_DEBUG")
                                                    else " (NVTP_DEBUG=1 prints the traceback)"), file=sys.stderr, flush=True)
    if wd is not None:
        wd.record_failure(rank, message, code)
    return code


def run_rank(rank: int, body: Callable[[], int | None]) -> int:
    """Run one rank's work: returns its exit code. An exception is printed as
    ``nvtp: rank r failed: ...`` and recorded for the other ranks (exit 3 for bad input, else 4);
    one caused by another rank's failure exits at once naming that rank."""
    try:
        code = body() or 0
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # noqa: BLE001 - every failure is reported, none is swallowed
        wd = _WATCHDOG
        code = _report(rank, e, wd, print_traceback=True)
        if wd is not None:
            wd.stop()
        return code
    wd = _WATCHDOG
    if wd is not None:
        if code not in (0, 1):  # 1: a check found results outside tolerance, the run itself completed
            wd.record_failure(rank, f"exited with code {code}", _failure_code(code))
            wd.stop()
        else:
            wd.finish()
    return code


@functools.cache
def _context():
    """The ranks' start method: a fork server that imported ``PRELOAD`` once (started by the first
    launch, kept for the process's life), or ``spawn`` where the platform has no fork server. A
    rank forked from the server gets the launcher's environment, standard output and error as
    they are at the launch (``_Inherited``), as a spawned one would."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD) + ([] if torch.cuda.is_available() else list(PRELOAD_WITHOUT_GPU)))
    return ctx


class _Inherited:
    """The launcher's standard output and error and its environment, carried to a rank: the fork
    server's own are those of the first launch (under pytest, an earlier test's capture files)."""

    def __init__(self):
        self.env = dict(os.environ)

    def __reduce__(self):  # the file descriptors travel with the process when it is pickled at its start
        return _Inherited._received, (self.env, reduction.DupFd(1), reduction.DupFd(2))

    @staticmethod
    def _received(env: dict, out, err) -> dict:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in ((out.detach(), 1), (err.detach(), 2)):
            if fd != target:  # spawn hands the descriptor itself over
                os.dup2(fd, target)
                os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        return env


def _entry(rank: int, fn: Callable, world: int, init_method: str, args: tuple, inherited: Any = None) -> None:
    code = run_rank(rank, lambda: fn(rank, world, init_method, *args))
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # a failed rank's teardown could wait on dead peers


# ---------------------------------------------------------------------------------------------
# the launcher


@dataclass
class RankExit:
    rank: int
    code: int
    seconds: float

    def __str__(self) -> str:
        return f"rank {self.rank} {describe_exit(self.code)} after {self.seconds:.1f} s"


class ExitCodes(list):
    """The ranks' exit codes (a list), with ``first_failure`` (the first rank to exit non-zero,
    a ``RankExit``), ``cause`` (the first failure the ranks recorded, a ``PeerFailure``: the root
    cause, e.g. a hung rank another rank gave up on) and ``terminated`` (ranks the launcher
    stopped after the grace period)."""

    first_failure: RankExit | None = None
    cause: PeerFailure | None = None
    terminated: list[int]

    def summary(self) -> str:
        if self.first_failure is None:
            return "every rank succeeded" if not any(self) else f"exit codes {list(self)}"
        cause = str(self.cause) if self.cause is not None else str(self.first_failure)
        codes = ", ".join(f"rank {r} {describe_exit(c)}" for r, c in enumerate(self))
        stopped = f"; the launcher stopped rank(s) {self.terminated} after the grace period" if self.terminated else ""
        return f"{cause}; {codes}{stopped}"


def _failure_code(code: int) -> int:
    """The code a failed rank's exit records for the mesh: bad input stays bad input, anything
    else (an error, a signal) is a failure at run time."""
    return EXIT_BAD_INPUT if code == EXIT_BAD_INPUT else EXIT_RUNTIME


def spawn(fn: Callable[..., int], world: int, *args: Any, grace: float = GRACE_S) -> ExitCodes:
    """Run ``fn(rank, world, init_method, *args)`` in ``world`` processes (forked from a server
    that imported torch, Thunder and nvtp once: ``_context``); their exit codes.

    When a rank exits non-zero or is killed, the launcher records how in the mesh's store (the
    other ranks' watchdogs name it), waits up to ``grace`` seconds for the others to stop, then
    terminates them (SIGTERM, then SIGKILL)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    init_method = f"nvtp://127.0.0.1:{store.port}"
    ctx = _context()
    procs = [ctx.Process(target=_entry, args=(r, fn, world, init_method, args, _Inherited()), name=f"nvtp-rank{r}", daemon=False)
             for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    codes: list[int | None] = [None] * world
    result = ExitCodes()
    result.terminated = []
    deadline: float | None = None
    killed_at: float | None = None
    while any(c is None for c in codes):
        running = {p.sentinel: r for r, p in enumerate(procs) if codes[r] is None}
        multiprocessing.connection.wait(list(running), timeout=0.2)
        now = time.monotonic()
        for r, p in enumerate(procs):
            if codes[r] is not None or p.exitcode is None:
                continue
            p.join()
            codes[r] = p.exitcode
            if p.exitcode != 0:
                how = describe_exit(p.exitcode)
                with contextlib.suppress(Exception):
                    _record(store, r, how, _failure_code(p.exitcode))
                if result.first_failure is None:
                    result.first_failure = RankExit(r, p.exitcode, now - start)
                    deadline = now + grace
                    if any(c is None for c in codes):
                        cause = _first_recorded(store, world)
                        why = f" (the first failure recorded is rank {cause.rank}'s)" if cause is not None and cause.rank != r else ""
                        say(f"nvtp: {result.first_failure}{why}; stopping the other ranks (they get {grace:.0f} s)")
        if deadline is not None and now > deadline and any(c is None for c in codes):
            if killed_at is None:
                for r, p in enumerate(procs):
                    if codes[r] is None:
                        result.terminated.append(r)
                        p.terminate()
                killed_at = now
            elif now > killed_at + 3.0:
                for r, p in enumerate(procs):
                    if codes[r] is None:
                        p.kill()
    result.extend(c if c is not None else 1 for c in codes)
    if result.first_failure is not None:
        result.cause = _first_recorded(store, world)
    return result


def _first_recorded(store, world: int) -> PeerFailure | None:
    with contextlib.suppress(Exception):
        found = recorded_failures(store, world)
        return found[0] if found else None
    return None
