"""The model's tokenizer, read from its directory with every problem named (the frontend's first file read).

Flow: TokenizerManager (and the training CLI) -> `load_tokenizer(directory, flag)`: the directory must hold a
tokenizer transformers can read without a download (tokenizer.json, or tokenizer_config.json with the files it
names); a directory without any tokenizer file, or one transformers cannot read (a tokenizer.json that is not JSON
named as such, checked only then), is named with the flag that chose the directory, instead of transformers' own
message (which speaks of sentencepiece and hub downloads).
"""

from __future__ import annotations

import json
import os

from transformers import AutoTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(directory: str, flag: str):
    """AutoTokenizer of `directory` (local files only); ValueError naming the directory, the file and `flag`
    (the setting that names the directory, e.g. '--tokenizer-path') when it cannot be read."""
    fix = "point --tokenizer-path at them" if flag == "--tokenizer-path" else "pass --tokenizer-path DIR"
    if not any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        raise ValueError(
            f"{flag} '{directory}' holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the model's "
            f"tokenizer files there, or {fix}"
        )
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        _check_tokenizer_json(directory)  # read only after a failure: a large tokenizer.json is parsed once
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"the tokenizer in {flag} '{directory}' cannot be loaded ({first_line[:300]}); its files are incomplete "
            "or of a kind this install cannot read"
        ) from None


def _check_tokenizer_json(directory: str) -> None:
    """ValueError naming tokenizer.json when it is there but not JSON."""
    tokenizer_json = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        return
    try:
        with open(tokenizer_json, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{tokenizer_json} cannot be read as JSON ({e}); re-download the tokenizer files") from None
