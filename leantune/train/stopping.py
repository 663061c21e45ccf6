"""How a training process stops on SIGTERM or Ctrl-C, within a bound it names.

docker stop, systemd, Slurm and `timeout` send SIGTERM and, after a grace period, SIGKILL; a run
must stop in that grace period with its state intact. Two rules:

- Inside a step, a first signal is deferred to the step's end (`StopRequest`), so the saved state
  is exact; a second one aborts the step (nothing of it is saved). Outside a step (caching,
  loading, planning, sampling, saving) a signal stops at once (`terminate_as_interrupt`).
- Python runs a signal handler only between bytecodes of the main thread, so one long native
  operation (a VAE encode of a 4096 px image: one attention call of minutes on a CPU) kept the
  process alive, "stopping" but not stopped, until it returned (153 s, measured). `StopWatchdog`
  hears each signal at once (CPython writes its number to `signal.set_wakeup_fd` from the C
  handler) and ends the process with a line when the run is still going `STOP_BOUND_S` seconds
  after a SIGTERM. (It needs the GIL for that: torch's operators and PIL's decoders release it.)

The bound: a SIGTERM ends the run within STOP_BOUND_S seconds, plus the time it takes to write the
resumable state it saves on the way out (a save is never cut short by the first signal); a SIGTERM
inside a step ends it at the step's end, then the same. A second signal (SIGTERM after SIGTERM or
Ctrl-C) ends it within STOP_BOUND_S in every phase, saves included. Saves are atomic, so a process
ended this way leaves the last saved state intact; its run-folder lock is released on the way.
Ctrl-C alone is never forced: the session it interrupts may be an interactive one (a notebook's
kernel) that must live on. The watch ends with `train()`: the CLI's exit after it has nothing
long left to wait for (the loaders' thread pools are shut down inside the run).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from contextlib import nullcontext
from typing import Callable

log = logging.getLogger("leantune")

STOP_BOUND_S = 5.0          # the most a SIGTERM waits for the run to end by itself
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM (docker stop, systemd, Slurm, `timeout`), handled like Ctrl-C: the CLI exits 143."""

    signal_name = "SIGTERM"


def _interrupt(signum) -> KeyboardInterrupt:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


class StopWatchdog:
    """A thread that hears stop signals as they arrive and ends the process when the run is still
    going STOP_BOUND_S seconds after a SIGTERM (module docstring). One per training run, while
    `terminate_as_interrupt` is entered; main thread only.

    A SIGTERM arms it, except the first stop signal inside a step (that one waits for the step's
    end: `leave_step` arms it then); `saving()` holds the clock while a resumable state is written,
    unless a second signal came. Ctrl-C alone never arms it. `close()` (the run returned or
    raised) disarms it: a caller that goes on after the interrupt is not ended.
    """

    def __init__(self, bound: float = STOP_BOUND_S, on_exit: Callable[[], None] | None = None):
        self.bound, self.on_exit = bound, on_exit
        self.phase = "setting up"        # what the run is doing, for the line (set_phase)
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._signals = 0              # stop signals heard (SIGINT and SIGTERM)
        self._term = False             # a SIGTERM among them: only that arms the clock
        self._hard = False             # a second signal: saves do not hold the clock
        self._in_step = False
        self._step_signals = 0
        self._saving_since: float | None = None
        self._closed = False
        self._previous_fd = -1
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._thread = threading.Thread(target=self._run, name="leantune-stop-watchdog", daemon=True)

    # -- the main thread's side ------------------------------------------------------------------

    def start(self) -> "StopWatchdog":
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread.start()
        return self

    def close(self) -> None:
        """The run returned or raised: stop listening and disarm (the thread ends)."""
        if signal.set_wakeup_fd(self._previous_fd, warn_on_full_buffer=False) != self._write:
            signal.set_wakeup_fd(-1)               # someone replaced ours meanwhile: leave theirs alone
        with self._lock:
            self._closed, self._deadline = True, None
        os.close(self._write)                      # end of file: the thread reads what is left and ends

    def enter_step(self) -> None:
        with self._lock:
            self._in_step, self._step_signals = True, 0

    def leave_step(self) -> None:
        """The step ended; a stop asked for inside it is carried out now: the clock starts."""
        with self._lock:
            self._in_step = False
            if self._step_signals and self._term:
                self._arm(time.monotonic())
        self._poke()

    def saving(self) -> "_Saving":
        """Context for writing a resumable state: the first signal's clock waits for it."""
        return _Saving(self)

    # -- the thread ------------------------------------------------------------------------------

    def _poke(self) -> None:
        try:
            os.write(self._write, b"\0")           # 0 is no signal: it only wakes the thread
        except OSError:
            pass

    def _arm(self, now: float) -> None:
        if self._deadline is None and not self._closed:
            self._deadline = now + self.bound

    def _heard(self, signum: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._signals += 1
            self._term = self._term or signum == signal.SIGTERM
            if self._in_step:
                self._step_signals += 1
            if not self._term or (self._in_step and self._step_signals == 1 and self._signals == 1):
                return            # Ctrl-C alone, or a first signal inside a step: deferred to its end (StopRequest)
            if self._signals > 1 and not self._closed:
                self._hard = True
                self._deadline = min(self._deadline or now + self.bound, now + self.bound)
            self._arm(now)

    def _run(self) -> None:
        while True:
            with self._lock:
                deadline = self._deadline
                held = self._saving_since is not None and not self._hard
            timeout = None if deadline is None else (0.2 if held else max(0.0, deadline - time.monotonic()))
            ready, _, _ = select.select([self._read], [], [], timeout)
            if ready:
                data = os.read(self._read, 64)
                if not data:                                  # close(): the run ended
                    os.close(self._read)
                    return
                for byte in data:
                    if self._previous_fd >= 0 and byte:
                        try:
                            os.write(self._previous_fd, bytes([byte]))   # the fd's earlier owner hears it too
                        except OSError:
                            pass
                    if byte in _STOP_SIGNALS:
                        self._heard(byte)
                continue
            with self._lock:
                late = (self._deadline is not None and time.monotonic() >= self._deadline
                        and (self._saving_since is None or self._hard))
            if late:
                self._end()

    def _end(self) -> None:
        message = (f"leantune: still running {self.bound:g} s after SIGTERM, while {self.phase} (one long operation "
                   f"kept Python from stopping); ending the process now, the last saved state is intact\n")
        try:
            os.write(2, message.encode())
            _log_without_waiting(message.strip())
            if self.on_exit is not None:
                self.on_exit()
        finally:
            os._exit(128 + signal.SIGTERM)


class _Saving:
    def __init__(self, dog: StopWatchdog):
        self.dog = dog

    def __enter__(self):
        with self.dog._lock:
            self.dog._saving_since = time.monotonic()
        return self

    def __exit__(self, *exc):
        dog = self.dog
        with dog._lock:
            if dog._deadline is not None and not dog._hard:
                dog._deadline += time.monotonic() - dog._saving_since    # the save's time is not counted
            dog._saving_since = None
        return False


def _log_without_waiting(message: str) -> None:
    """The watchdog's line in the run's log files, skipping a handler another thread holds (the
    main thread may be stuck inside one: waiting on it would defeat the bound)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in log.handlers:
        if isinstance(handler, logging.FileHandler) and handler.lock is not None and handler.lock.acquire(timeout=0.5):
            try:
                handler.emit(record)
                handler.flush()
            except Exception:
                pass
            finally:
                handler.lock.release()


_watchdog: StopWatchdog | None = None      # the training process's, while terminate_as_interrupt is entered


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def set_phase(phase: str) -> None:
    """What the run is doing, for the watchdog's line ("caching", "step 12", "sampling")."""
    if _watchdog is not None:
        _watchdog.phase = phase


def saving():
    """Context around writing a resumable state (see StopWatchdog.saving); a no-op without a watchdog."""
    return _watchdog.saving() if _watchdog is not None else nullcontext()


class StopRequest:
    """Ctrl-C or SIGTERM during a step is deferred to the step's end, so the saved state is exact.

    Used as a context manager around each step: a first SIGINT/SIGTERM inside it only sets
    `requested` (the loop saves and stops after the step); a second one aborts at once, and then
    nothing is saved, since a half-done optimizer update must not become a resumable state. Outside
    a step (saving, sampling) both interrupt at once (`terminate_as_interrupt`). Only the main
    thread can own the handlers. The watchdog's bound (STOP_BOUND_S) starts at the step's end, or
    at a second signal.
    """

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        self.aborted_mid_step = False
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.requested:
            raise _interrupt(signum)
        self.requested, self.signum = True, signum
        what = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        bound = (f"; the process ends within {STOP_BOUND_S:g} s of the step's end, plus the save"
                 if signum == signal.SIGTERM else "")
        log.warning("%s: stopping after this step with a resumable state (a second signal aborts now%s)", what, bound)

    def stop(self) -> KeyboardInterrupt:
        """The exception that ends the loop after a requested stop."""
        return _interrupt(self.signum)

    def __enter__(self):
        if _main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in _STOP_SIGNALS}
            if _watchdog is not None:
                _watchdog.enter_step()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self.aborted_mid_step = True      # however it was raised, the step did not finish
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        if self._previous and _watchdog is not None:
            _watchdog.leave_step()
        self._previous = {}
        return False


class terminate_as_interrupt:
    """While training, SIGTERM raises `Terminated` (a KeyboardInterrupt) like Ctrl-C does, so the
    run saves its state, logs a line and releases the folder lock; by default it would end the
    process at once. A `StopWatchdog` bounds the stop (STOP_BOUND_S, module docstring); `on_exit`
    runs before the watchdog ends the process (the run folder's lock is released there). Main
    thread only (elsewhere a no-op)."""

    def __init__(self, on_exit: Callable[[], None] | None = None):
        self.on_exit = on_exit

    def __enter__(self):
        global _watchdog
        self._previous = None
        self._dog = None
        if _main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._dog, self._outer = StopWatchdog(on_exit=self.on_exit).start(), _watchdog
            _watchdog = self._dog
        return self

    @staticmethod
    def _handle(signum, frame):
        log.warning("SIGTERM: stopping now (the process ends within %g s, plus the time to save a resumable state)",
                    STOP_BOUND_S)
        raise Terminated()

    def __exit__(self, *exc):
        global _watchdog
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        if self._dog is not None:
            self._dog.close()
            _watchdog = self._outer
        return False
