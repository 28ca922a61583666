"""The agent's signals, its wake-up pipe, and the blocking calls a signal (or a drain) cuts short.

torch's agent installs handlers that raise ``SignalException`` in the main thread; a store call
blocked in C++ then hears of it only when the call returns. Here every signal also writes to a
wake-up pipe (``signal.set_wakeup_fd``), the run loop and ``call`` wait on it, and a stop signal
raises ``SignalStop`` at once (``--signals-to-handle``, torch's ``TORCHELASTIC_SIGNALS_TO_HANDLE``),
a drain signal requests a drain, a forwarded one goes to the workers.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsm_agent._early_signals import note_stop

if TYPE_CHECKING:
    from fsm_agent.drain import NodeDrain

log = logging.getLogger(__name__)

#: The Interrupts whose handlers are installed now (``install`` .. ``restore``): ``stop_taken``.
_installed: list[Interrupts] = []


def empty_pipe(fd: int) -> None:
    """Read whatever is in the non-blocking pipe ``fd`` (a wake-up pipe)."""
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


#: Seconds between two looks at ``stop_taken`` in a wait that cannot be interrupted otherwise.
STOP_LOOK_S = 0.1


def stop_taken() -> int | None:
    """The stop signal the agent running in this process took, or None (none runs, or it took
    none). For a wait in the agent's thread outside its interruptible calls (a plugin's check
    command): it looks between short waits and ends when the agent is on its way out."""
    return _installed[-1].signal if _installed else None


class SignalStop(BaseException):
    """Raised by the signal handler to interrupt a blocking rendezvous or exit barrier."""

    def __init__(self, signum: int):
        super().__init__(f"received signal {signal.Signals(signum).name}")
        self.signum = signum


class DrainInterrupt(BaseException):
    """Raised to cut a rendezvous wait short when a drain is requested; the run loop's next step
    fires ``drain_requested`` from the state the interrupted transition left the group in."""


class Interrupts:
    """One agent's signal handling and interruptible calls.

    Args:
        stop_signals: signal numbers that stop the job (``--signals-to-handle``).
        forwarded: signal numbers relayed to every live worker (``--forward-signals``).
        launcher: the agent's launcher (``pids``, ``signal_worker``).
        python_waits: the rendezvous handler's blocking calls are Python waits that ``SignalStop``
            raised from the handler interrupts (``RendezvousAdapter.interruptible``).

    ``drains`` (the agent's ``NodeDrain``, made on ``wake_w``) is set by the agent right after.
    """

    def __init__(self, stop_signals: list[int], forwarded: list[int], launcher: Any, python_waits: bool) -> None:
        self._stop_signals = stop_signals
        self._forwarded = forwarded
        self._launcher = launcher
        self._python_waits = python_waits
        self.drains: NodeDrain
        #: the first stop signal received, or None
        self.signal: int | None = None
        #: workers were running when it came (they get the same signal)
        self.stopped_workers = False
        #: a Python wait runs in this thread now: the stop-signal handler raises SignalStop into it
        self.interruptible = False
        #: A store call abandoned to a stop signal still holds its client: any other call on that
        #: client would block behind it, so the way out makes none.
        self.abandoned_call: str | None = None
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def close(self) -> None:
        """Close the wake-up pipe (after ``restore_wakeup_fd``)."""
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``; a stop signal cuts it short (SignalStop)."""
        self.interruptible = True
        try:
            if self.signal is not None:
                raise SignalStop(self.signal)
            select.select([], [], [], seconds)
        finally:
            self.interruptible = False

    def on_signal(self, signum: int, frame: Any) -> None:
        """A stop signal (``--signals-to-handle``): the first stops the job (its workers get the same
        signal, the agent exits 128+N); another while they stop SIGKILLs them at once (a second Ctrl-C)."""
        if self.signal is None:
            self.signal = signum
            note_stop(signum)  # the CLI's early handlers, back once run() ends, then ignore stop signals
            name = signal.Signals(signum).name
            self.stopped_workers = bool(self._launcher.pids())
            if self.stopped_workers:
                log.warning("received %s: stopping the workers with %s", name, name)
            else:
                log.warning("received %s: stopping (no workers running)", name)
            if self.interruptible:
                raise SignalStop(signum)
            return
        pids = self._launcher.pids()
        if pids:
            log.warning("received %s again: killing the workers (SIGKILL)", signal.Signals(signum).name)
        for local_rank in pids:
            self._launcher.signal_worker(local_rank, signal.SIGKILL)

    def call(
        self,
        name: str,
        call: Callable[[], Any],
        *,
        interruptible: bool = True,
        timeout: float | None = None,
        drainable: bool = False,
        busies_store: bool = True,
    ) -> Any:
        """``call()`` (a rendezvous or store call that may block), cut short by a stop signal.

        torch's store calls (TCPStore's connect and ``wait_for_workers`` in StaticTCPRendezvous,
        ``store.wait`` in the exit barrier, a plugin's network client) block in C++ and retry on EINTR: a
        Python signal handler runs only once they return, minutes later. So ``call`` runs in a
        daemon thread and this thread waits on the signal wakeup fd, which every signal makes
        readable whatever thread the kernel delivers it to. A stop signal then raises SignalStop at
        once; the abandoned call ends with the process (the CLI exits with ``os._exit``; the
        rendezvous ``shutdown()`` is skipped on a signal, as in torch). Short timeouts in a retry
        loop would not do: a store host that gives up after each short wait drops the clients that
        already joined it. A backend whose blocking calls are Python (``interruptible = True``, as
        the ``fsm`` backend's select-based waits) runs in this thread, where SignalStop interrupts
        it, so its ``shutdown()`` (called on a signal too) never races a join still running.

        Args:
            name: the helper thread's name (``fsm-agent-<name>``).
            interruptible: False: a stop signal does not cut the wait short (a check-in on the way out).
            timeout: seconds to wait at most (None: as long as ``call`` takes).
            busies_store: False: ``call`` uses a store connection of its own, so abandoning it
                leaves the rendezvous store free for the way out (leave, release).
            drainable: a drain request cuts the wait short too (a rendezvous: a node given notice
                while it waits for others leaves at once). A backend whose waits are Python is cut
                short only by a drain signal; a drain by file or HTTP then acts once the call returns.

        Returns:
            what ``call`` returned.

        Raises:
            SignalStop: a stop signal arrived first (``interruptible``), or had arrived before.
            DrainInterrupt: a drain was requested first (``drainable``), or had been before.
            TimeoutError: ``timeout`` passed first.
            whatever ``call`` raised.
        """
        self._raise_if_cut_short(interruptible, drainable)
        if self._python_waits:
            return self._call_here(call, interruptible=interruptible, drainable=drainable)
        return self._call_in_thread(
            name, call, interruptible=interruptible, timeout=timeout, drainable=drainable, busies_store=busies_store
        )

    def _raise_if_cut_short(self, interruptible: bool, drainable: bool) -> None:
        """Raise SignalStop for a stop signal that arrived (``interruptible``), DrainInterrupt for a
        drain that was requested (``drainable``): a wait they cut short must not start or go on."""
        if interruptible and self.signal is not None:
            raise SignalStop(self.signal)
        if drainable and self.drains.request is not None:
            raise DrainInterrupt()

    def _call_here(self, call: Callable[[], Any], *, interruptible: bool, drainable: bool) -> Any:
        """``call()`` (a backend's Python wait) in this thread, where the stop and drain signals'
        handlers raise SignalStop and DrainInterrupt into it while it runs."""
        self.interruptible = interruptible  # the handler raises SignalStop into call()
        self.drains.interruptible = drainable
        try:
            return call()
        finally:
            self.interruptible = self.drains.interruptible = False

    def _call_in_thread(
        self,
        name: str,
        call: Callable[[], Any],
        *,
        interruptible: bool,
        timeout: float | None,
        drainable: bool,
        busies_store: bool,
    ) -> Any:
        """``call()`` (a wait blocked in C++) in a daemon thread ``fsm-agent-<name>``, while this
        thread waits for it, a signal or ``timeout`` seconds; an abandoned call that ``busies_store``
        is recorded in ``abandoned_call``. Returns what ``call`` returned, or raises what it raised."""
        outcome: dict[str, Any] = {}
        done_r, done_w = os.pipe()

        def run_call() -> None:
            try:
                outcome["value"] = call()
            except BaseException as exc:  # re-raised in the agent's thread
                outcome["error"] = exc
            finally:
                try:
                    os.write(done_w, b"x")
                except OSError:  # the agent stopped waiting and closed its end
                    pass
                os.close(done_w)

        finished = False
        try:
            threading.Thread(target=run_call, name=f"fsm-agent-{name}", daemon=True).start()
            self._wait_until_done(name, done_r, interruptible=interruptible, timeout=timeout, drainable=drainable)
            finished = True
        finally:
            os.close(done_r)
            if not finished and busies_store:
                self.abandoned_call = name
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _wait_until_done(
        self, name: str, done_r: int, *, interruptible: bool, timeout: float | None, drainable: bool
    ) -> None:
        """Wait until ``done_r`` (the helper thread's end-of-call pipe) is readable.

        Raises:
            SignalStop: a stop signal arrived first (``interruptible``).
            DrainInterrupt: a drain was requested first (``drainable``).
            TimeoutError: ``timeout`` seconds (None: no limit) passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # the handler only records the signal here; the loop's next turn acts on it
            self._raise_if_cut_short(interruptible, drainable)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([done_r, self.wake_r], [], [], remaining)
            if done_r in ready:
                return
            if not ready:
                raise TimeoutError(f"{name} did not finish within {timeout:g}s")
            self.empty_wake_pipe()  # a signal woke us: its Python handler runs before the next turn

    def on_drain_signal(self, signum: int, frame: Any) -> None:
        """A drain signal (``--drain-signals``): request a drain of the configured scope."""
        self.drains.ask(source="signal", by=signal.Signals(signum).name)
        if self.interruptible and self.drains.interruptible:  # a Python rendezvous wait: cut it short
            raise DrainInterrupt()

    def empty_wake_pipe(self) -> None:
        """Read what signals and ``request_drain`` wrote to the wake-up pipe (non-blocking)."""
        empty_pipe(self.wake_r)

    def signalled(self) -> bool:
        """A stop signal has arrived."""
        return self.signal is not None

    def forward_signal(self, signum: int, frame: Any) -> None:
        """Relay ``signum`` to each running worker's process group; nothing is stopped."""
        for local_rank in self._launcher.pids():
            self._launcher.signal_worker(local_rank, signum)

    def install(self) -> dict[int, Any]:
        """Install the stop, forwarded and drain signals' handlers and the wake-up fd (main thread
        only); returns what they replaced, for ``restore`` (key -1: the previous wake-up fd)."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            log.warning("agent not in the main thread: signals are not handled")
            return previous
        _installed.append(self)
        for sig in self._stop_signals:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: keep ignoring SIGHUP
            previous[sig] = signal.signal(sig, self.on_signal)
        for sig in self._forwarded:
            previous[sig] = signal.signal(sig, self.forward_signal)
        for sig in self.drains.settings.signals:
            previous[sig] = signal.signal(sig, self.on_drain_signal)
        previous[-1] = signal.set_wakeup_fd(self.wake_w)
        return previous

    def restore(self, previous: dict[int, Any]) -> None:
        """Put back what ``install`` replaced."""
        if self in _installed:
            _installed.remove(self)
        self.restore_wakeup_fd(previous)
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    @staticmethod
    def restore_wakeup_fd(previous: dict[int, Any]) -> None:
        """Put back the previous wake-up fd alone (before the pipe closes; the handlers stay)."""
        wakeup = previous.pop(-1, None)
        if wakeup is not None:
            signal.set_wakeup_fd(wakeup)
