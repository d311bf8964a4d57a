"""A --config file (JSON or YAML) of engine settings, read and checked against ServerArgs' fields.

Where it sits: launch.py and Engine(config=...) call server_args.load_config_file, which hands the dataclass
fields to `read_config_file` here; the result is {field: value}, used as defaults under the CLI flags or keywords.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os


def read_config_file(path: str, fields: tuple[dataclasses.Field, ...]) -> dict:
    """A JSON or YAML file of the given dataclass fields -> {field: value}, every key and value type checked.

    Keys are the field names (`tp_size`; `tp-size` and `--tp-size` are accepted too). Raises ValueError
    naming the file, the bad key and the closest field."""
    try:
        with open(os.path.expanduser(path)) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(
            f"--config {path}: cannot read the file ({e.strerror}); pass the path of a JSON or YAML file"
        ) from e
    raw = _parse_config_text(path, text)
    if not isinstance(raw, dict):
        raise ValueError(
            f'--config {path}: the file must hold a mapping of ServerArgs fields, e.g. {{"tp_size": 4}}; got {type(raw).__name__}'
        )
    fields = {f.name: f for f in fields}
    config = {}
    for key, value in raw.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = (
                f"did you mean '{close[0]}'?" if close else "see `python -m sgl_jax_lora.launch --help` for the fields"
            )
            raise ValueError(f"--config {path}: unknown key '{key}'; {hint}")
        if name in config:
            raise ValueError(f"--config {path}: '{key}' sets '{name}' again; keep one spelling of each key")
        config[name] = _check_config_value(path, name, str(fields[name].type), value)
        choices = fields[name].metadata.get("choices")
        if choices and config[name] not in choices:
            raise ValueError(f"--config {path}: '{name}' is {value!r}; choose one of {list(choices)}")
    return config


def _parse_config_text(path: str, text: str) -> object:
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise ValueError(
                f"--config {path}: reading YAML needs PyYAML; `pip install pyyaml`, or write the file as JSON"
            ) from e
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path}: not valid YAML: {e}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}: not valid JSON ({e}); name a YAML file *.yaml / *.yml to write YAML") from e


def _check_config_value(path: str, name: str, type_text: str, value: object) -> object:
    """The value if it fits the field's annotation (`int`, `float | None`, `list[str] | None`, ...)."""
    if value is None and "None" in type_text:
        return value
    if name == "lora_paths" and isinstance(value, (dict, list)):  # {name: path}, or entries as strings or objects
        entries = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else value
        if all(isinstance(v, str) for v in entries) or all(isinstance(v, (str, dict)) for v in entries):
            return [json.dumps(v) if isinstance(v, dict) else v for v in entries]
    if type_text.startswith("list"):
        item_type = int if "list[int]" in type_text else str
        if isinstance(value, list) and all(isinstance(v, item_type) and not isinstance(v, bool) for v in value):
            return value
        expected = f"a list of {item_type.__name__}"
    elif type_text.startswith("bool"):
        if isinstance(value, bool):
            return value
        expected = "true or false"
    elif type_text.startswith("int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        expected = "an integer"
    elif type_text.startswith("float"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        expected = "a number"
    else:
        if isinstance(value, str):
            return value
        expected = "a string"
    raise ValueError(f"--config {path}: '{name}' must be {expected}, got {value!r}")
