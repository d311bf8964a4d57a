"""Which module paths a PEFT LoRA config targets, and each one's rank and alpha: PEFT's own rules, over a config's
pattern fields as plain JSON data (`PeftLoRAConfig.pattern_fields()`), so that one module gets the same rank, alpha
and scaling here as in `PeftModel`:
  - target_modules as a string: `re.fullmatch(pattern, module_path)`;
  - as a list: exact full path, or path ending in `.{name}`; only then `layers_to_transform` applies,
    the layer index being the first number after a `{layers_pattern}.` segment (any segment if unset);
  - exclude_modules: the same two forms, a match leaves the module out;
  - rank_pattern / alpha_pattern: the first key (in file order) with `re.match(rf"(.*\\.)?({key})$", path)`.

Flow: peft_config.module_settings evaluates `settings_of` once per adapter over the base model's module paths:
in its own process when the config holds a client's regular expressions, since Python's `re` backtracks (a
pattern such as `(a|a)*b` takes exponential time) and holds the interpreter while it matches; this file is then
run as a script (`python -I -S peft_targets.py`, JSON in on stdin, out on stdout), so it imports the standard
library alone.
"""

from __future__ import annotations

import json
import re
import sys


def targets(fields: dict, module_path: str) -> bool:
    """Whether PEFT would put a LoRA layer on `module_path` (its check_target_module_exists rule)."""
    if _is_excluded(fields.get("exclude_modules"), module_path):
        return False
    target_modules = fields["target_modules"]
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module_path) is not None
    if module_path in target_modules:
        return True
    if not any(module_path.endswith(f".{t}") for t in target_modules):
        return False
    layers = fields.get("layers_to_transform")
    if not layers:
        return True
    layer_index = _layer_index_of(module_path, fields.get("layers_pattern"))
    return layer_index is not None and layer_index in layers


def rank_and_alpha(fields: dict, module_path: str) -> tuple[int, float]:
    """The module's rank and alpha: its rank_pattern / alpha_pattern entries, else the config's r and lora_alpha."""
    rank = _pattern_value(fields.get("rank_pattern") or {}, module_path, fields["r"])
    alpha = _pattern_value(fields.get("alpha_pattern") or {}, module_path, fields["lora_alpha"])
    return int(rank), float(alpha)


def settings_of(fields: dict, module_paths: list[str]) -> dict[str, tuple[int, float]]:
    """module path -> (rank, alpha), for each of `module_paths` the config targets."""
    return {path: rank_and_alpha(fields, path) for path in module_paths if targets(fields, path)}


def _is_excluded(exclude_modules: str | list[str] | None, module_path: str) -> bool:
    if not exclude_modules:
        return False
    if isinstance(exclude_modules, str):
        return re.fullmatch(exclude_modules, module_path) is not None
    return module_path in exclude_modules or any(module_path.endswith(f".{e}") for e in exclude_modules)


def _pattern_value(patterns: dict, module_path: str, default: float) -> float:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return patterns[key]
    return default


def _layer_index_of(module_path: str, layers_pattern: list[str] | None) -> int | None:
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_path)
    else:
        match = None
        for pattern in layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module_path)
            if match is not None:
                break
    return int(match.group("idx")) if match else None


def main() -> None:
    """stdin {"fields", "module_paths", "cpu_seconds"} -> stdout {module path: [rank, alpha]} of the targeted ones;
    the kernel stops this process (SIGXCPU) once it has used cpu_seconds of CPU (where the platform can say so)."""
    request = json.load(sys.stdin)
    try:
        import resource

        limit = int(request["cpu_seconds"])
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))
    except (ImportError, ValueError, OSError):  # no CPU limits here: the parent's wall-time limit alone bounds it
        pass
    json.dump(settings_of(request["fields"], request["module_paths"]), sys.stdout)


if __name__ == "__main__":
    main()
