"""An adapter config's module settings over the base model: which module paths it targets, with what rank and
alpha (peft_targets.py's rules, PEFT's own), evaluated once per adapter.

Flow: adapter.py's validation -> `module_settings(name, config, module_paths)` -> {path: (rank, alpha)}. A config
with regular expressions of its own (a string target_modules or exclude_modules, rank_pattern, alpha_pattern,
layers_pattern) is matched in a child process that limits its own CPU time to PATTERN_MATCH_CPU_S: Python's `re`
backtracks (a pattern such as `(a|a)*b` takes exponential time) and holds the interpreter while it matches, so in
the server's own process one client's config could stall every request. The child runs peft_targets.py as a
script of the standard library alone (tens of milliseconds); other configs are matched in process. A refusal is
remembered (the same config is refused at once); a child that a busy host kept past PATTERN_MATCH_WALL_S is not.
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys

from sgl_jax_lora.lora import peft_targets
from sgl_jax_lora.lora.adapter_files import adapter_error
from sgl_jax_lora.lora.peft_config import PeftLoRAConfig

PATTERN_MATCH_CPU_S = 2  # a config's regular expressions over a model's module paths: milliseconds if benign
PATTERN_MATCH_WALL_S = 20.0  # the child's wall time on a busy host (its CPU time is what PATTERN_MATCH_CPU_S bounds)


class PatternMatchUnfinished(RuntimeError):
    """The child ran out of wall time before its CPU time (a busy host): not remembered, a later load tries again."""


def module_settings(name: str, config: PeftLoRAConfig, module_paths: list[str]) -> dict[str, tuple[int, float]]:
    """module path -> (rank, alpha) of each path the config targets (peft_targets.py's rules). A config with
    regular expressions of its own is matched in a child process given PATTERN_MATCH_CPU_S of CPU time, so a pattern
    that backtracks for ever costs that child, not the server; one that runs out of it is refused, naming it."""
    fields = config.pattern_fields()
    if not config.has_client_patterns:
        return peft_targets.settings_of(fields, module_paths)
    request = json.dumps({"fields": fields, "module_paths": module_paths, "cpu_seconds": PATTERN_MATCH_CPU_S})
    try:
        settings = _settings_in_child(request)
    except PatternMatchUnfinished:
        raise adapter_error(
            name,
            f"matching its regular expressions did not finish within {PATTERN_MATCH_WALL_S:g} s (the host is busy)",
            "load it again",
        ) from None
    except (OSError, RuntimeError) as e:  # no Python to run it (an embedded interpreter), or the child failed
        raise adapter_error(
            name,
            f"its regular expressions could not be matched in a child process ({e})",
            "name target_modules as a list of modules, and leave out rank_pattern, alpha_pattern, layers_pattern and "
            "a string exclude_modules",
        ) from None
    if settings is None:
        raise adapter_error(
            name,
            f"its regular expressions (target_modules, exclude_modules, rank_pattern, alpha_pattern or "
            f"layers_pattern) took over {PATTERN_MATCH_CPU_S} s of CPU to match the base model's "
            f"{len(module_paths)} module paths",
            "simplify them: PEFT matches each against every module path, e.g. target_modules '.*\\.(q_proj|v_proj)'",
        )
    return {path: (int(rank), float(alpha)) for path, (rank, alpha) in settings.items()}


@functools.lru_cache(maxsize=256)
def _settings_in_child(request: str) -> dict | None:
    """peft_targets.py run as a script of the standard library alone, which limits its own CPU time; None if it ran
    out of it (remembered, so a config sent again is refused at once). PatternMatchUnfinished past the wall time."""
    command = [sys.executable, "-I", "-S", peft_targets.__file__]
    try:
        done = subprocess.run(command, input=request, capture_output=True, text=True, timeout=PATTERN_MATCH_WALL_S)
    except subprocess.TimeoutExpired:
        raise PatternMatchUnfinished from None
    cpu_limit_signal = getattr(signal, "SIGXCPU", None)  # where the platform has CPU limits
    if cpu_limit_signal is not None and done.returncode == -cpu_limit_signal:  # stopped at its CPU limit
        return None
    if done.returncode != 0:
        raise RuntimeError(f"matching an adapter config's patterns failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)
