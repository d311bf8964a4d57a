"""Client- or file-given text as an error message quotes it: `cut(text, limit)`, the first `limit` characters and the
length of the whole (a client may send a megabyte-long name). lora/adapter_files.py (names and paths) and
server_args_checks.py (settings' values) quote through it."""

from __future__ import annotations


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"
