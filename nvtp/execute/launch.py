"""Start a mesh of processes on this machine, or join the one ``torchrun`` started; fail fast.

``spawn(fn, n, *args)`` runs ``fn(rank, n, init_method, *args)`` in ``n`` fresh processes and
returns their exit codes; ``init_group`` joins torch.distributed (gloo on CPU, NCCL when each rank
has a GPU). Neither lets a failure turn into a hang:

* The launcher hosts the mesh's key-value store (a c10d ``TCPStore``, as torchrun's agent does),
  watches its children and, when one exits non-zero or is killed, records how in the store,
  gives the others ``grace`` seconds to stop by themselves, then terminates them.
* Every rank runs a ``Watchdog`` thread (started by ``init_group``, or by ``nvtp.jit`` in a
  process group the caller made): it beats a heartbeat into the store every
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
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch

from nvtp.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, exit_code_for

HEARTBEAT_S = 0.5  # how often each rank beats and looks at its peers
GRACE_S = 5.0  # how long the launcher lets the other ranks stop by themselves after a failure
JOIN_TIMEOUT_S = 120.0  # how long a rank waits for the others to join (importing torch and tracing take a while)
_PREFIX = "nvtp/"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def init_group(rank: int, world: int, init_method: str | None, timeout_s: float = 60.0) -> None:
    """Join the default process group (unless the caller already did) and start this rank's
    watchdog. ``init_method``: ``nvtp://host:port`` (the store ``spawn`` hosts), ``tcp://...``,
    or None for torchrun's environment. ``timeout_s`` bounds every wait on a silent peer (the
    watchdog enforces it; joining waits up to ``max(timeout_s, JOIN_TIMEOUT_S)``, as the group's
    own timeout, for ranks that start slowly)."""
    import torch.distributed as dist

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
# processes: alive, gone, how they ended


def describe_exit(code: int) -> str:
    """``exited with code 4`` or ``was killed by SIGKILL``, from a multiprocessing exit code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _process_state(pid: int) -> tuple[bool, str | None]:
    """(alive, how it ended if known) for a process of this machine."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False, None
    except OSError:
        return True, None
    fields = stat[stat.rfind(")") + 2:].split()
    if fields and fields[0] in ("Z", "X"):  # a zombie: dead, its parent has not reaped it yet
        status = int(fields[49]) if len(fields) > 49 else None
        if status is None:
            return False, None
        return False, describe_exit(os.waitstatus_to_exitcode(status))
    return True, None


# ---------------------------------------------------------------------------------------------
# the watchdog


@dataclass
class PeerFailure:
    rank: int
    reason: str
    order: int = 1 << 30  # when it was recorded (the store's failure counter), first one first
    code: int = EXIT_RUNTIME  # the exit code its cause calls for: 3 bad input, 4 anything else

    def __str__(self) -> str:
        return f"rank {self.rank} failed: {self.reason}"


@dataclass
class _Peer:
    host: str | None = None
    pid: int | None = None
    done: bool = False
    beat: int = -1
    beat_changed: float = field(default_factory=time.monotonic)


def _record(store, rank: int, reason: str, code: int = EXIT_RUNTIME) -> None:
    key = f"{_PREFIX}failed/{rank}"
    if not store.check([key]):
        order = store.add(f"{_PREFIX}failures", 1)
        store.compare_set(key, "", f"{order}|{code}|{reason}")


def recorded_failures(store, world: int) -> list[PeerFailure]:
    """The failures recorded in a mesh's store, first recorded first."""
    found = []
    for r in range(world):
        key = f"{_PREFIX}failed/{r}"
        if store.check([key]):
            order, code, reason = (store.get(key).decode(errors="replace").split("|", 2) + ["", ""])[:3]
            found.append(PeerFailure(r, reason, int(order) if order.isdigit() else 1 << 30,
                                     int(code) if code.isdigit() else EXIT_RUNTIME))
    return sorted(found, key=lambda f: f.order)


def _is_store_error(e: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(e, (dist.DistError, ConnectionError, OSError))


class Watchdog:
    """One per process: heartbeats, failure records and peer checks through the mesh's store.

    Keys (under ``nvtp/``): ``pid/r`` (host:pid), ``beat/r`` (a counter), ``progress/r`` (this
    rank's collective count), ``failed/r`` ("order|reason", first writer wins), ``failures`` (a
    counter), ``done/r``, ``stopped/r`` (stopped because of another rank)."""

    def __init__(self, store, rank: int, world: int, timeout: float, *, hosts_store: bool, store_desc: str):
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout
        self.hosts_store, self.store_desc = hosts_store, store_desc
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.peers = {r: _Peer() for r in range(world) if r != rank}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._exiting = False
        self._failed_self = False
        self._seen_failures = 0
        self._last_beat_check = 0.0
        self._wakeup: tuple[int, int] | None = None
        self._sigterm = False
        self._thread = threading.Thread(target=self._loop, name="nvtp-watchdog", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> "Watchdog":
        self.store.set(self._key("pid", self.rank), f"{self.host}:{self.pid}")
        self.store.add(self._key("beat", self.rank), 1)
        self._install_sigterm()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * HEARTBEAT_S + 1)
        if self._wakeup is not None and threading.current_thread() is threading.main_thread() and not self._thread.is_alive():
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def finish(self) -> None:
        """This rank's work is done: say so, and if this process hosts the store (rank 0 under a
        ``tcp://`` init), wait until every rank is done or failed so nobody loses the store."""
        if self._failed_self or self._exiting:
            return
        with contextlib.suppress(Exception):
            self.store.set(self._key("done", self.rank), "1")
        if self.hosts_store:
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                try:
                    pending = [r for r in self.peers if not self._has(self._key("done", r))
                               and not self._has(self._key("failed", r)) and not self._has(self._key("stopped", r))]
                except Exception:  # noqa: BLE001 - the store is ours; nothing more to wait for
                    break
                if not pending:
                    break
                time.sleep(HEARTBEAT_S / 2)
        self.stop()

    # -- recording --------------------------------------------------------------------------

    def _key(self, kind: str, rank: int | None = None) -> str:
        return _PREFIX + kind + ("" if rank is None else f"/{rank}")

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def record_failure(self, rank: int, reason: str, code: int = EXIT_RUNTIME) -> None:
        """Record that ``rank`` failed (first record wins), so every rank names the same cause."""
        if rank == self.rank:
            self._failed_self = True
        with contextlib.suppress(Exception):
            _record(self.store, rank, reason, code)

    def failures(self) -> list[PeerFailure]:
        """Every failure recorded so far, first recorded first."""
        return recorded_failures(self.store, self.world)

    def _others_failures(self) -> list[PeerFailure]:
        # A failure this rank recorded itself is being reported by this rank's own code.
        return [f for f in self.failures() if not (f.rank == self.rank and self._failed_self)]

    # -- looking at the peers --------------------------------------------------------------------

    def find_failure(self, settle: float = 1.0, stuck_after: float | None = None) -> PeerFailure | None:
        """The first failure of another rank (or of this one, recorded by the others), if any.
        A peer found dead without a record gets ``settle`` seconds for the launcher's record
        (which says how it ended) to arrive. This rank waiting in a collective for more than
        ``stuck_after`` seconds (default: the timeout) names the ranks that never reached it."""
        n = self.store.add(self._key("failures"), 0)
        if n > self._seen_failures:
            self._seen_failures = n
            recorded = self._others_failures()
            if recorded:
                return recorded[0]
        for r, peer in self.peers.items():
            if peer.done:
                continue
            if peer.pid is None and self._has(self._key("pid", r)):
                host, _, pid = self.store.get(self._key("pid", r)).decode().rpartition(":")
                peer.host, peer.pid = host, int(pid)
            if peer.pid is None or peer.host != self.host:
                continue
            alive, how = _process_state(peer.pid)
            if alive:
                continue
            if self._has(self._key("done", r)):
                peer.done = True
                continue
            deadline = time.monotonic() + settle
            while time.monotonic() < deadline and not self._has(self._key("failed", r)):
                time.sleep(0.05)
            recorded = self._others_failures()
            if recorded:
                return recorded[0]
            if self._has(self._key("done", r)) or self._has(self._key("stopped", r)):
                peer.done = True
                continue
            reason = f"its process (pid {peer.pid}) {how}" if how else f"its process (pid {peer.pid}) is gone (killed?)"
            self.record_failure(r, reason)
            return PeerFailure(r, reason)
        now = time.monotonic()
        if now - self._last_beat_check >= max(HEARTBEAT_S, min(self.timeout / 4, 5.0)):
            self._last_beat_check = now
            for r, peer in self.peers.items():
                if peer.done:
                    continue
                key = self._key("beat", r)
                beat = self.store.add(key, 0)
                if beat != peer.beat:
                    peer.beat, peer.beat_changed = beat, now
                elif now - peer.beat_changed > self.timeout:
                    if self._has(self._key("done", r)):
                        peer.done = True
                        continue
                    reason = f"no heartbeat for {now - peer.beat_changed:.0f} s (hung, stopped, or its machine is unreachable)"
                    self.record_failure(r, reason)
                    return PeerFailure(r, reason)
        return self._stuck_collective(self.timeout if stuck_after is None else stuck_after)

    def _stuck_collective(self, stuck_after: float) -> PeerFailure | None:
        from nvtp.execute.collectives import PROGRESS

        since, mine = PROGRESS.since, PROGRESS.count
        if since is None or time.monotonic() - since <= stuck_after:
            return None
        behind = []
        for r, peer in self.peers.items():
            key = self._key("progress", r)
            theirs = int(self.store.get(key)) if self._has(key) else 0
            if theirs < mine and not peer.done:
                behind.append((r, theirs))
        waited = time.monotonic() - since
        if not behind:
            reason = f"collective #{mine} has not completed in {waited:.0f} s, though every rank reached it"
            self.record_failure(self.rank, reason)
            return PeerFailure(self.rank, reason)
        r, theirs = behind[0]
        reason = (f"hung: rank {self.rank} waited {waited:.0f} s in collective #{mine}, which rank {r} never reached "
                  f"(rank {r} last reported collective #{theirs}: alive, but not making progress)")
        self.record_failure(r, reason)
        return PeerFailure(r, reason)

    def diagnose(self, wait: float = 2.0, timed_out: bool = False) -> PeerFailure | None:
        """After a collective failed in this rank: which peer failed, looking for up to ``wait`` s
        (``timed_out``: the collective timed out, so ranks that never reached it are to blame)."""
        deadline = time.monotonic() + wait
        while True:
            try:
                found = self.find_failure(settle=max(0.0, deadline - time.monotonic()), stuck_after=0.0 if timed_out else None)
            except Exception:  # noqa: BLE001 - the store is gone with its host
                return self._store_lost()
            if found is not None and found.rank != self.rank:
                return found
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def _store_lost(self) -> PeerFailure | None:
        if self.store_desc.startswith("rank 0"):
            return PeerFailure(0, f"lost contact with it (it hosts the mesh's store, {self.store_desc}): it died")
        return PeerFailure(-1, f"the mesh's store ({self.store_desc}) is gone: the launcher died")

    # -- stopping ----------------------------------------------------------------------------

    def abort(self, failure: PeerFailure, how: str = "stopping") -> None:
        """Print why this rank stops and exit at once (``os._exit``: no teardown that could hang)."""
        with self._lock:
            if self._exiting:
                return
            self._exiting = True
        who = "the launcher" if failure.rank < 0 else f"rank {failure.rank}"
        if failure.rank == self.rank:
            line = f"nvtp: rank {self.rank} {how}: {failure.reason}"
        else:
            line = f"nvtp: rank {self.rank} {how}: {who} failed: {failure.reason}"
        with contextlib.suppress(Exception):
            self.store.set(self._key("stopped", self.rank), line)
        # The cause decides the code: every rank of a mesh stopped by bad input exits 3.
        _exit_now(line, failure.code)

    def _loop(self) -> None:
        from nvtp.execute.collectives import PROGRESS

        while not self._stop.is_set():
            self._sleep(HEARTBEAT_S)
            if self._stop.is_set():
                return
            try:
                if self._sigterm:
                    found = self.diagnose(wait=2.0)
                    if found is None:  # the others may have recorded this rank itself as failed
                        found = next(iter(self.failures()), None)
                    if found is None:
                        _exit_now(f"nvtp: rank {self.rank} stopped by SIGTERM (no failed rank recorded)", 128 + signal.SIGTERM)
                    self.abort(found, "stopping (SIGTERM)")
                    return
                self.store.add(self._key("beat", self.rank), 1)
                self.store.set(self._key("progress", self.rank), str(PROGRESS.count))
                found = self.find_failure()
            except Exception as e:  # noqa: BLE001 - the store host is gone
                if self._stop.is_set():
                    return
                if not _is_store_error(e):
                    raise
                found = self._store_lost()
            if found is not None:
                self.abort(found)
                return

    def _sleep(self, seconds: float) -> None:
        if self._wakeup is None:
            self._stop.wait(seconds)
            return
        import select

        r, _ = self._wakeup
        ready, _, _ = select.select([r], [], [], seconds)
        if ready:
            with contextlib.suppress(OSError):
                data = os.read(r, 64)
                if signal.SIGTERM in data:
                    self._sigterm = True

    def _install_sigterm(self) -> None:
        """On SIGTERM (torchrun stops the others when a rank fails) the watchdog thread names the
        failed rank before exiting, even while the main thread is blocked in a collective: the
        C-level handler writes the signal to a wakeup pipe this thread selects on."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the program handles SIGTERM itself
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r)
            os.close(w)
            return
        if old != -1:  # someone else (e.g. asyncio) uses the wakeup fd: leave it to them
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self._wakeup = (r, w)

        def on_sigterm(signum, frame):  # the watchdog thread does the work; make sure we go
            threading.Timer(HEARTBEAT_S + 5.0, lambda: os._exit(128 + signal.SIGTERM)).start()

        signal.signal(signal.SIGTERM, on_sigterm)


def _exit_now(line: str, code: int) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    _say(line)
    os._exit(code)


def _say(line: str) -> None:
    """Write one line to stderr in a single ``write``: ranks share the pipe, so lines must not interleave."""
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except Exception:  # noqa: BLE001 - stderr replaced by an object without a file descriptor
        with contextlib.suppress(Exception):
            print(line, file=sys.stderr, flush=True)


_WATCHDOG: Watchdog | None = None


def start_watchdog(timeout_s: float, init_method: str | None = None) -> Watchdog | None:
    """Start this rank's watchdog in the default process group (once per process); None when
    the group's store is not a TCP store nvtp can reach."""
    global _WATCHDOG
    import torch.distributed as dist

    if _WATCHDOG is not None and not _WATCHDOG._stop.is_set():
        return _WATCHDOG
    rank, world = dist.get_rank(), dist.get_world_size()
    address = _store_address(init_method)
    if address is None:
        return None
    host, port, hosts_store, desc = address
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=min(timeout_s, 30.0)))
    _WATCHDOG = Watchdog(store, rank, world, timeout_s, hosts_store=hosts_store and rank == 0, store_desc=desc).start()
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
    import torch.distributed as dist

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
        previous(kind, value, tb)
        if wd is not None and not wd._exiting and isinstance(value, Exception):
            _report(wd.rank, value, wd, print_traceback=False)

    sys.excepthook = hook

    def at_exit():
        wd = _WATCHDOG
        if wd is not None:
            wd.finish()

    atexit.register(at_exit)


# ---------------------------------------------------------------------------------------------
# a rank's work


def _looks_like_communication(e: BaseException) -> bool:
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "gloo", "Gloo", "NCCL", "Broken pipe"))


def describe_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if "Timed out waiting" in str(e):
        return f"a collective timed out ({text})"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _report(rank: int, e: BaseException, wd: Watchdog | None, print_traceback: bool) -> int:
    """Print and record ``e``; returns its exit code. If it came from a peer's failure, name the
    peer and exit at once."""
    if wd is not None and _looks_like_communication(e):
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


def _entry(rank: int, fn: Callable, world: int, init_method: str, args: tuple) -> None:
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
    """Run ``fn(rank, world, init_method, *args)`` in ``world`` processes; their exit codes.

    When a rank exits non-zero or is killed, the launcher records how in the mesh's store (the
    other ranks' watchdogs name it), waits up to ``grace`` seconds for the others to stop, then
    terminates them (SIGTERM, then SIGKILL)."""
    import multiprocessing.connection
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    init_method = f"nvtp://127.0.0.1:{store.port}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, fn, world, init_method, args), name=f"nvtp-rank{r}", daemon=False)
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
                        _say(f"nvtp: {result.first_failure}{why}; stopping the other ranks (they get {grace:.0f} s)")
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
