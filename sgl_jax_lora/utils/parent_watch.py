"""Ending a child process whose parent is gone: the engine process of a frontend that was SIGKILLed.

A frontend that exits normally stops its engine process, and a running engine exits when the frontend's pipe
closes; but an engine still starting (loading weights, compiling, or blocked on a file) reads no pipe, and a
SIGKILLed parent runs no cleanup. `exit_when_parent_dies` starts a daemon thread that polls the parent's pid and
ends this process (exit code 1) once it changes (the process was re-parented). Linux's PR_SET_PDEATHSIG is not used:
it fires when the parent *thread* that started the child ends, and the HTTP server starts its engine from a
startup thread that ends once the engine is up.
"""

from __future__ import annotations

import os
import sys
import threading
import time

POLL_S = 1.0


def exit_when_parent_dies(poll_s: float = POLL_S) -> threading.Thread:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"[engine {os.getpid()}] its frontend (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
