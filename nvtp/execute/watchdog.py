"""Each rank's watchdog: heartbeats, failure records and peer checks through the mesh's key-value store.

A ``Watchdog`` thread (started by ``nvtp.execute.launch.start_watchdog``) beats a heartbeat into
the mesh's store every ``HEARTBEAT_S`` and stops its rank, naming the failed one, when:

* a peer recorded a failure (an exception, a bad input, a hang it saw);
* a peer's process on this machine is gone (killed), with how it ended when the launcher says;
* a peer's heartbeat has been silent for ``timeout`` seconds (hung, stopped, machine unreachable);
* this rank has waited ``timeout`` seconds in one communication (``collectives.PROGRESS``): it
  names the rank that never reached it. A communication that says which ranks it waits on (a
  point-to-point receive of a pipeline, a collective on a sub-group) is followed through the ranks
  those wait on in turn to the one that waits on nobody: alive, but not communicating. One on the
  whole default group (every rank runs the same collectives) names the ranks whose count of
  collectives is behind this rank's.

A communication that raises (a peer's connection closed) is reported to the watchdog at once
(``Progress.on_failure``), which names the failed peer instead of the raw transport error.
Every rank that stops prints one line ``nvtp: rank r stopping: rank k failed: ...`` and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import select
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from nvtp.errors import EXIT_RUNTIME
from nvtp.execute.collectives import PROGRESS

HEARTBEAT_S = 0.5  # how often each rank beats and looks at its peers
COMPILE_S = 300.0  # how long a peer may trace and shard a model (``Progress.busy``) before a rank waiting on it names it
_PREFIX = "nvtp/"

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
        self.hosted = None  # the store this rank hosts, held until the peers are done (nvtp.execute.launch.start_watchdog)
        self._thread = threading.Thread(target=self._loop, name="nvtp-watchdog", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> "Watchdog":
        self.store.set(self._key("pid", self.rank), f"{self.host}:{self.pid}")
        self.store.add(self._key("beat", self.rank), 1)
        self._install_sigterm()
        PROGRESS.on_failure = self.communication_failed
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if PROGRESS.on_failure == self.communication_failed:
            PROGRESS.on_failure = None
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
        self._stop.set()  # no heartbeat after "done": the store's host may exit as soon as it reads it
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * HEARTBEAT_S + 1)
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
            if rank == self.rank:  # it knows it failed: a store host need not wait for it to read the record
                self.store.set(self._key("stopped", rank), reason)

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

    def _progress_of(self, r: int) -> tuple[int, str | None, tuple[float, str] | None]:
        """Rank ``r``'s count of communications, what it waits on now (None: nothing; "*": every
        rank; else ranks joined by commas) and what it is busy with (None, or (seconds so far,
        what): compiling), as its watchdog last published them (``Progress.published``)."""
        key = self._key("progress", r)
        if not self._has(key):
            return 0, None, None
        count, bar, state = self.store.get(key).decode().partition("|")
        if not bar:
            return int(count or 0), None, None
        if state.startswith("~"):
            started, _, what = state[1:].partition("~")
            return int(count or 0), None, (time.time() - float(started), what)
        return int(count or 0), state, None

    def _still_busy(self, busy: tuple[float, str] | None) -> bool:
        return busy is not None and busy[0] < max(self.timeout, COMPILE_S)

    def _stuck_collective(self, stuck_after: float) -> PeerFailure | None:
        since, mine = PROGRESS.since, PROGRESS.count
        if since is None or time.monotonic() - since <= stuck_after:
            return None
        waited = time.monotonic() - since
        if PROGRESS.peers is not None:
            return self._stuck_on(PROGRESS.peers, PROGRESS.what, mine, waited)
        behind = []
        for r, peer in self.peers.items():
            theirs, _, busy = self._progress_of(r)
            if theirs < mine and not peer.done:
                if self._still_busy(busy):
                    return None  # it is compiling (its first call): not hung yet
                behind.append((r, theirs, busy))
        if not behind:
            reason = f"collective #{mine} has not completed in {waited:.0f} s, though every rank reached it"
            self.record_failure(self.rank, reason)
            return PeerFailure(self.rank, reason)
        r, theirs, busy = behind[0]
        reason = (f"hung: rank {self.rank} waited {waited:.0f} s in collective #{mine}, which rank {r} never reached "
                  f"(rank {r} last reported collective #{theirs}: alive, but not making progress{_busy_text(busy)})")
        self.record_failure(r, reason)
        return PeerFailure(r, reason)

    def _stuck_on(self, peers: tuple[int, ...], what: str, mine: int, waited: float) -> PeerFailure | None:
        """This rank waits on ``peers`` (a receive, a collective on a sub-group): follow the ranks
        they wait on in turn to one that waits on nobody (alive, not communicating: hung there;
        one still compiling within ``COMPILE_S`` is given the time)."""
        held_by: dict[int, int] = {}  # a rank found waiting -> the rank it was reached through
        frontier = [r for r in peers if r != self.rank]
        seen = {self.rank}
        while frontier:
            r = frontier.pop(0)
            if r in seen or r not in self.peers or self.peers[r].done or self._has(self._key("done", r)):
                seen.add(r)
                continue
            seen.add(r)
            theirs, waiting, busy = self._progress_of(r)
            if waiting is None:
                if self._still_busy(busy):
                    return None
                doing = f" ({what})" if what else ""
                if r in peers:
                    reason = (f"hung: rank {self.rank} waited {waited:.0f} s in collective #{mine}{doing}, which rank {r} never "
                              f"reached (rank {r} last reported collective #{theirs}: alive, but not making progress"
                              f"{_busy_text(busy)})")
                else:
                    chain = [r]
                    while chain[-1] in held_by:
                        chain.append(held_by[chain[-1]])
                    through = ", ".join(f"rank {k}" for k in reversed(chain[1:]))
                    reason = (f"hung: rank {self.rank} waited {waited:.0f} s in collective #{mine}{doing} on {through}, which "
                              f"wait(s) on rank {r}; rank {r} is alive but in no communication (it last reported collective "
                              f"#{theirs}{_busy_text(busy)}): not making progress")
                self.record_failure(r, reason)
                return PeerFailure(r, reason)
            nxt = [k for k in range(self.world) if k != r] if waiting == "*" else [int(k) for k in waiting.split(",") if k]
            for k in nxt:
                if k not in seen:
                    held_by.setdefault(k, r)
                    frontier.append(k)
        reason = (f"collective #{mine}{f' ({what})' if what else ''} has not completed in {waited:.0f} s, though every rank it "
                  "waits on is itself waiting in a communication (a deadlock, or a network too slow for the timeout)")
        self.record_failure(self.rank, reason)
        return PeerFailure(self.rank, reason)

    def communication_failed(self, e: BaseException) -> None:
        """A communication of this rank raised (``Progress.on_failure``): if a peer failed (its
        connection closed, its process gone), stop now naming it, rather than let the transport's
        error ("Connection reset by peer") reach the user. Otherwise return: the caller raises ``e``."""
        if not looks_like_communication(e):
            return
        if self._exiting:
            self._wait_for_exit()
            return
        recorded = self._others_failures()
        found = recorded[0] if recorded else self.diagnose(wait=2.0, timed_out="Timed out" in str(e) or "timeout" in str(e).lower())
        if found is not None:
            self.abort(found)

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
            if self._exiting:  # another thread is stopping this process: let it finish, rather than go on here
                self._wait_for_exit()
                return
            self._exiting = True
        who = "the launcher" if failure.rank < 0 else f"rank {failure.rank}"
        if failure.rank == self.rank:
            line = f"nvtp: rank {self.rank} {how}: {failure.reason}"
        else:
            line = f"nvtp: rank {self.rank} {how}: {who} failed: {failure.reason}"
        with contextlib.suppress(Exception):
            self.store.set(self._key("stopped", self.rank), line)
        if self.hosts_store:  # the others learn of the failure through this process's store: let them read it first
            with contextlib.suppress(Exception):
                self._let_peers_stop()
        # The cause decides the code: every rank of a mesh stopped by bad input exits 3.
        _exit_now(line, failure.code)

    def _wait_for_exit(self) -> None:
        if threading.current_thread() is not self._thread:
            time.sleep(4 * HEARTBEAT_S + 3.0)  # the stopping thread exits the process well before

    def _let_peers_stop(self) -> None:
        """Wait (a few heartbeats at most) until every peer has stopped, finished or is gone."""
        deadline = time.monotonic() + 4 * HEARTBEAT_S + 1.0
        while time.monotonic() < deadline:
            pending = [r for r, peer in self.peers.items() if not (
                self._has(self._key("stopped", r)) or self._has(self._key("done", r))
                or (peer.pid is not None and peer.host == self.host and not _process_state(peer.pid)[0]))]
            if not pending:
                return
            time.sleep(HEARTBEAT_S / 5)

    def _loop(self) -> None:
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
                self.store.set(self._key("progress", self.rank), PROGRESS.published())
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
    say(line)
    os._exit(code)


def say(line: str) -> None:
    """Write one line to stderr in a single ``write``: ranks share the pipe, so lines must not interleave."""
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except Exception:  # noqa: BLE001 - stderr replaced by an object without a file descriptor
        with contextlib.suppress(Exception):
            print(line, file=sys.stderr, flush=True)



def looks_like_communication(e: BaseException) -> bool:
    """Whether ``e`` came from a transport (a closed connection, a timed-out collective)."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "gloo", "Gloo", "NCCL", "Broken pipe"))


def _busy_text(busy: tuple[float, str] | None) -> str:
    return f"; it has been {busy[1]} for {busy[0]:.0f} s" if busy is not None else ""
