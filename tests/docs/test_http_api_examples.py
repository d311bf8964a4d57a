"""The examples of docs/http_api.md are what the demo server answers: every `<!-- doc-example -->` block (a
`curl ... -d '{...}'` command, then the JSON it returns) is sent to a real server started as the doc starts it
(`python -m sgl_jax_lora.launch`, default flags, the demo model) on 127.0.0.1, and the answer must have exactly
the shown keys, at every level, and the shown values. Values that differ per call are compared by type only:
ids, `created` timestamps and `cached_tokens` (it depends on what earlier requests left in the prefix cache).
Every example is greedy (temperature 0), so the rest is deterministic.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal

import httpx
import pytest

from tests.support import REPO_ROOT
from tests.support.http_helpers import start_server

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

REPO = REPO_ROOT
DOC = os.path.join(REPO, "docs", "http_api.md")
EXAMPLE = re.compile(r"<!-- doc-example -->\s*```bash\n(.*?)```\s*```json\n(.*?)```", re.S)
PER_CALL = {"id", "created", "cached_tokens"}
STARTUP_TIMEOUT_S = 900  # the README's default buckets; the tests' shared compilation cache makes later starts quick


def doc_examples() -> list[tuple[str, dict, object]]:
    """[(path, request body, shown answer)] of every marked example, in the doc's order."""
    with open(DOC) as f:
        text = f.read()
    examples = []
    for command, shown in EXAMPLE.findall(text):
        words = shlex.split(command.replace("\\\n", " "))
        assert words[0] == "curl", command
        url = next(w for w in words if w.startswith("http://127.0.0.1:30000/"))
        body = json.loads(words[words.index("-d") + 1])
        examples.append((url.removeprefix("http://127.0.0.1:30000"), body, json.loads(shown)))
    return examples


def differences(shown: object, actual: object, where: str = "") -> list[str]:
    if isinstance(shown, dict):
        if not isinstance(actual, dict):
            return [f"{where or 'answer'}: shown an object, got {actual!r}"]
        found = [f"{where}.{k}: shown, not returned" for k in shown.keys() - actual.keys()]
        found += [f"{where}.{k}: returned, not shown" for k in actual.keys() - shown.keys()]
        for key in shown.keys() & actual.keys():
            if key in PER_CALL:
                if type(shown[key]) is not type(actual[key]):
                    found.append(f"{where}.{key}: shown a {type(shown[key]).__name__}, got {actual[key]!r}")
                continue
            found += differences(shown[key], actual[key], f"{where}.{key}")
        return found
    if isinstance(shown, list):
        if not isinstance(actual, list) or len(shown) != len(actual):
            return [f"{where}: shown {shown!r}, got {actual!r}"]
        return [d for i, (s, a) in enumerate(zip(shown, actual)) for d in differences(s, a, f"{where}[{i}]")]
    return [] if shown == actual else [f"{where}: shown {shown!r}, got {actual!r}"]


EXAMPLES = doc_examples()


def test_the_doc_marks_its_generation_examples():
    paths = [path for path, _, _ in EXAMPLES]
    assert {"/generate", "/v1/completions", "/v1/chat/completions"} <= set(paths), paths
    for path, body, _ in EXAMPLES:  # deterministic only when greedy
        if path in ("/tokenize", "/detokenize"):  # no sampling
            continue
        params = body.get("sampling_params", body)
        for p in params if isinstance(params, list) else [params]:
            assert p.get("temperature") == 0, body


def test_differences_catches_a_drifted_example():
    shown = {"id": "a", "text": "x", "meta_info": {"cached_tokens": 0, "n": 1}}
    assert differences(shown, {"id": "b", "text": "x", "meta_info": {"cached_tokens": 16, "n": 1}}) == []
    assert sorted(
        differences(shown, {"id": "b", "text": "y", "meta_info": {"cached_tokens": 0, "n": 1, "extra": 2}})
    ) == [
        ".meta_info.extra: returned, not shown",
        ".text: shown 'x', got 'y'",
    ]


@pytest.fixture(scope="module")
def demo_server():
    server = start_server([], timeout_s=STARTUP_TIMEOUT_S)  # the doc's command; only --port is added
    yield server
    server.stop(signal.SIGKILL)


@pytest.mark.parametrize(("path", "body", "shown"), EXAMPLES, ids=[f"{i}:{p}" for i, (p, _, _) in enumerate(EXAMPLES)])
def test_example_answers_as_shown(demo_server, path, body, shown):
    response = httpx.post(demo_server.url + path, content=json.dumps(body), timeout=120)  # as curl -d sends it
    assert response.status_code == 200, response.text
    assert differences(shown, response.json()) == [], (
        f"docs/http_api.md's example for {path} no longer matches; update it"
    )
