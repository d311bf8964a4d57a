"""Start-up compile progress a person can watch, on a terminal or in a log file.

Flow: the engine process's EngineCore passes `startup_progress` as the `progress` factory of
`ModelRunner.warmup`, which calls `startup_progress(total=, desc=)` once, then `.update(1)` per compiled
program (from the compile threads too) and `.close()`. On a terminal it draws a tqdm bar that a
background thread redraws every second, so the elapsed time moves even while one long compile runs;
otherwise (a log file, a pipe, a container's log) it logs one line every 10 s:

    compiling buckets: 12/26 programs, 1m05s elapsed, about 1m16s left

and a last line with the total time.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
REDRAW_INTERVAL_S = 1.0


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class StartupProgress:
    """tqdm's interface (`total=`, `desc=`, `.update(n)`, `.close()`), thread-safe; draws or logs as above.

    `stream` defaults to stderr; `is_tty` to `stream.isatty()`; `clock` to time.monotonic. `background`
    False starts no thread (the caller calls `tick()`), as the tests do."""

    def __init__(
        self,
        total: int,
        desc: str = "compiling",
        stream: TextIO | None = None,
        is_tty: bool | None = None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
    ):
        self.total = total
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty() if is_tty is None else is_tty
        self.interval_s = (
            interval_s if interval_s is not None else (REDRAW_INTERVAL_S if self.is_tty else LOG_INTERVAL_S)
        )
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.bar = tqdm(total=total, desc=desc, file=self.stream, **_bar_width(self.stream)) if self.is_tty else None
        if not self.is_tty:
            logger.info("%s: %d programs to compile (a line every %s)", desc, total, format_duration(self.interval_s))
        self.thread = threading.Thread(target=self._run, name="startup-progress", daemon=True) if background else None
        if self.thread is not None:
            self.thread.start()

    def update(self, n: int = 1) -> None:
        with self.lock:
            self.done += n
            if self.bar is not None:
                self.bar.update(n)

    def status_line(self) -> str:
        """'desc: done/total programs, elapsed, estimate' from the mean time per program so far."""
        elapsed = self.clock() - self.start
        line = f"{self.desc}: {self.done}/{self.total} programs, {format_duration(elapsed)} elapsed"
        if 0 < self.done < self.total:
            line += f", about {format_duration(elapsed / self.done * (self.total - self.done))} left"
        elif self.done == 0:
            line += ", estimate after the first program"
        return line

    def tick(self) -> None:
        """One periodic report: redraw the bar (terminal) or log the status line."""
        with self.lock:
            if self.bar is not None:
                self.bar.refresh()
            else:
                logger.info("%s", self.status_line())

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        if self.thread is not None:
            self.thread.join()
        with self.lock:
            if self.bar is not None:
                self.bar.close()
            else:
                elapsed = format_duration(self.clock() - self.start)
                logger.info("%s: %d/%d programs in %s", self.desc, self.done, self.total, elapsed)

    def _run(self) -> None:
        while not self.closed.wait(self.interval_s):
            self.tick()


def _bar_width(stream: TextIO) -> dict:
    """Follow the terminal's width, or 100 columns where it reports none: a pseudo-terminal opened without a
    size (`docker run -t`, `script`, CI runners) reports 0 columns, and tqdm would draw an empty bar."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = 0
    return {"dynamic_ncols": True} if columns > 0 else {"ncols": 100}


def startup_progress(total: int, desc: str = "compiling") -> StartupProgress:
    """The progress factory for `ModelRunner.warmup(..., progress=startup_progress)`."""
    return StartupProgress(total=total, desc=desc)
