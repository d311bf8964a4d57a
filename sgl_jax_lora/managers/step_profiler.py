"""A trace of the engine's steps on request (POST /start_profile, `Engine.start_profile`), by jax.profiler.

Where it sits: the engine process's EngineLoop owns one StepProfiler (managers/engine_process.py). Its
StartProfileCall and StopProfileCall reach `start` and `stop`, and the loop calls `step_done` after each step
that ran, so a trace asked for N steps stops by itself. A trace is written only under --profile-dir, the server's
own flag: a request chooses how many steps to trace, never where the trace goes. Each trace gets a directory of
its own, `<profile-dir>/<UTC time>-<pid>[-n]`, with jax.profiler's files: TensorBoard's `.xplane.pb` and a
Perfetto `.trace.json.gz`, which `scripts/trace_busy.py` reads for the device's busy and idle time.

What a trace holds: every op of the process's devices and the host's annotated calls (JAX's dispatch, XLA's
runtime) from `start` until `stop`; not each Python call (JAX's Python tracer, which slowed a serving engine's loop
several times over, is off). With the overlap schedule the step launched last may still run when a trace of N steps
stops; its ops may be cut short. Stopping a trace writes its files, which holds the engine loop up meanwhile
(seconds to a minute for a long trace on a GPU), so a trace of a benchmark is best stopped after its requests.

What exists here: StepProfiler.
"""

from __future__ import annotations

import os
import time

from sgl_jax_lora.managers.io_struct import ProfileStarted, ProfileStopped


class StepProfiler:
    def __init__(self, profile_dir: str | None):
        # --profile-dir, absolute; None: profiling is off
        self.profile_dir = None if profile_dir is None else os.path.abspath(os.path.expanduser(profile_dir))
        self.trace_dir: str | None = None  # the running trace's directory
        self.num_steps = 0  # steps the running trace holds so far
        self.max_steps: int | None = None  # the trace stops by itself after this many steps; None: at `stop`
        self.last: ProfileStopped | None = None  # the trace written last

    @property
    def is_running(self) -> bool:
        return self.trace_dir is not None

    def start(self, num_steps: int | None = None) -> ProfileStarted:
        """Begin a trace of the next `num_steps` steps (None: until `stop`). ValueError naming the fix when
        profiling is off, a trace is running already, or num_steps is not a positive integer."""
        if self.profile_dir is None:
            raise ValueError(
                "profiling is off: restart the server with --profile-dir DIR (the directory its traces are written to)"
            )
        if self.trace_dir is not None:
            raise ValueError(f"a profile is running already (into {self.trace_dir}); stop it first (/stop_profile)")
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
            raise ValueError(
                f"num_steps must be a positive integer (the steps to trace), got {num_steps!r}; "
                "or leave it out to trace until /stop_profile"
            )
        import jax  # the frontend imports this module with the engine process's, and never loads JAX

        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # JAX's default records every Python call: the engine loop runs 4x slower
        trace_dir = self._new_trace_dir()
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)
        self.trace_dir, self.num_steps, self.max_steps = trace_dir, 0, num_steps
        return ProfileStarted(trace_dir=trace_dir, num_steps=num_steps)

    def step_done(self) -> None:
        """A step ran: counted in the running trace, which stops here once it holds the steps it was asked for."""
        if self.trace_dir is None:
            return
        self.num_steps += 1
        if self.max_steps is not None and self.num_steps >= self.max_steps:
            self._stop()

    def stop(self) -> ProfileStopped:
        """End the running trace and write its files -> where they are and the steps they hold; ValueError when no
        trace is running (naming the last one written, if any)."""
        if self.trace_dir is None:
            last = f" (the last one, {self.last.num_steps} steps, is in {self.last.trace_dir})" if self.last else ""
            raise ValueError(f"no profile is running{last}; start one with /start_profile")
        return self._stop()

    def _stop(self) -> ProfileStopped:
        import jax

        jax.profiler.stop_trace()
        self.last = ProfileStopped(trace_dir=self.trace_dir, num_steps=self.num_steps)
        self.trace_dir, self.max_steps = None, None
        return self.last

    def _new_trace_dir(self) -> str:
        """A directory of its own under --profile-dir, created here (a second trace in one second gets `-n`)."""
        stem = os.path.join(self.profile_dir, time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{os.getpid()}")
        path, n = stem, 1
        while True:
            try:
                os.makedirs(path)
                return path
            except FileExistsError:
                n += 1
                path = f"{stem}-{n}"
