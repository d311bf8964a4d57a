"""utils/progress.py: the startup compile progress. Off a terminal it logs 'desc: done/total programs,
elapsed, about N left' at each tick and a total at close; on a terminal (a real pseudo-terminal here) it
draws a tqdm bar. The clock is passed in and ticks are called by the test, so nothing depends on timing.
"""

from __future__ import annotations

import logging
import os

from sgl_jax_lora.utils.progress import StartupProgress, format_duration, startup_progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_format_duration():
    assert [format_duration(s) for s in (0.4, 59, 65, 3600 + 120)] == ["0s", "59s", "1m05s", "1h02m"]


def test_log_lines_off_a_terminal(caplog):
    caplog.set_level(logging.INFO, logger="sgl_jax_lora.utils.progress")
    clock = Clock()
    bar = StartupProgress(total=10, desc="compiling buckets", is_tty=False, clock=clock, background=False)
    bar.tick()
    clock.now += 65
    bar.update(3)
    bar.tick()
    clock.now += 135
    bar.update(7)
    bar.close()
    bar.close()  # a second close is a no-op
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "compiling buckets: 10 programs to compile (a line every 10s)",
        "compiling buckets: 0/10 programs, 0s elapsed, estimate after the first program",
        "compiling buckets: 3/10 programs, 1m05s elapsed, about 2m32s left",  # 65 s / 3 * 7
        "compiling buckets: 10/10 programs in 3m20s",
    ]


def read_all(fd: int) -> str:
    """Everything written so far to the terminal (already in its buffer: the writes have returned)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def test_bar_on_a_pseudo_terminal():
    """A pseudo-terminal opened without a size reports 0 columns (as under `docker run -t`): still drawn."""
    controller, terminal = os.openpty()
    with os.fdopen(terminal, "w") as stream:
        assert stream.isatty()
        bar = StartupProgress(total=4, desc="compiling buckets", stream=stream, clock=Clock(), background=False)
        assert bar.is_tty
        bar.update(1)
        bar.tick()
        bar.close()
        stream.flush()
        drawn = read_all(controller)
    os.close(controller)
    assert "compiling buckets" in drawn
    assert "1/4" in drawn and "4/4" not in drawn  # update(1) drawn; close does not fill the bar


def test_factory_runs_its_reporting_thread_until_closed(caplog):
    caplog.set_level(logging.INFO, logger="sgl_jax_lora.utils.progress")
    bar = startup_progress(total=2, desc="compiling buckets")
    assert bar.thread is not None and bar.thread.is_alive()
    bar.update(2)
    bar.close()
    assert not bar.thread.is_alive()
