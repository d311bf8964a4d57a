"""POST /load_lora_adapter_from_tensors and /update_lora_adapter on a launched server (127.0.0.1 only).

The adapter's safetensors file travels base64 in the JSON body; the served tokens must equal the same adapter
loaded from its directory with --lora-paths, and an update must show up as version 2 in /v1/models and meta_info.
"""

from __future__ import annotations

import base64
import json
import signal

import httpx
import pytest

from sgl_jax_lora.demo_model import demo_model_path
from tests.support.http_helpers import SMALL_ENGINE_FLAGS, start_server
from tests.support.peft_fixtures import write_peft_adapter

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

KEY = "tensors-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensors_api")
    adapters = {
        name: write_peft_adapter(
            demo_model_path(),
            root / name,
            seed=seed,
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            b_std=0.5,
        )
        for name, seed in (("a0", 1), ("a1", 2))
    }
    srv = start_server(
        [
            *SMALL_ENGINE_FLAGS,
            "--api-key",
            KEY,
            "--max-loras-per-batch",
            "3",
            "--lora-paths",
            f"a0={adapters['a0']}",
            f"a1={adapters['a1']}",
        ]
    )
    yield srv, adapters
    srv.stop(signal.SIGKILL)


def body_of(adapter_dir) -> tuple[str, dict]:
    tensors = base64.b64encode((adapter_dir / "adapter_model.safetensors").read_bytes()).decode()
    return tensors, json.loads((adapter_dir / "adapter_config.json").read_text())


def generate(url: str, lora: str) -> dict:
    response = httpx.post(
        url + "/generate",
        headers=AUTH,
        timeout=60,
        json={"text": "Hello, world!", "lora_path": lora, "sampling_params": GREEDY},
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_load_from_tensors_then_update_over_http(lora_server):
    srv, adapters = lora_server
    tensors, config = body_of(adapters["a0"])
    body = {"lora_name": "mem", "tensors": tensors, "config": config}
    assert httpx.post(srv.url + "/load_lora_adapter_from_tensors", json=body).status_code == 401  # admin route
    loaded = httpx.post(srv.url + "/load_lora_adapter_from_tensors", json=body, headers=AUTH, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["version"] == 1
    mem = generate(srv.url, "mem")
    assert mem["output_ids"] == generate(srv.url, "a0")["output_ids"]
    assert mem["meta_info"]["lora_version"] == 1

    new_tensors, _ = body_of(adapters["a1"])
    updated = httpx.post(
        srv.url + "/v1/update_lora_adapter", headers=AUTH, timeout=60, json={"lora_name": "mem", "tensors": new_tensors}
    )
    assert updated.status_code == 200, updated.text
    after = generate(srv.url, "mem")
    assert after["meta_info"]["lora_version"] == 2
    assert after["output_ids"] == generate(srv.url, "a1")["output_ids"] != mem["output_ids"]
    cards = {card["id"]: card for card in httpx.get(srv.url + "/v1/models", headers=AUTH).json()["data"]}
    assert cards["mem"]["version"] == 2 and cards["a0"]["version"] == 1
    info = httpx.get(srv.url + "/get_server_info", headers=AUTH).json()
    assert info["num_compilations_after_warmup"] == 0


@pytest.mark.parametrize(
    "path, body, fragment",
    [
        ("/load_lora_adapter_from_tensors", {"lora_name": "x", "tensors": "not base64!", "config": {}}, "base64"),
        (
            "/load_lora_adapter_from_tensors",
            {
                "lora_name": "x",
                "tensors": base64.b64encode(b"junk").decode(),
                "config": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
            },
            "not a valid safetensors file",
        ),
        ("/load_lora_adapter_from_tensors", {"lora_name": "x", "tensors": ""}, "config"),
    ],
)
def test_bad_bodies_get_400_naming_the_problem(lora_server, path, body, fragment):
    srv, _ = lora_server
    response = httpx.post(srv.url + path, json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]


def test_adapter_calls_on_an_unknown_name_say_lora_not_found(lora_server):
    srv, adapters = lora_server
    tensors, _ = body_of(adapters["a0"])
    calls = [("/update_lora_adapter", {"tensors": tensors}), ("/unload_lora_adapter", {})]
    for path, body in calls:
        response = httpx.post(srv.url + path, json={"lora_name": "nope", **body}, headers=AUTH, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "lora_not_found", error
        assert "'nope': no LoRA adapter with this name is loaded (loaded: a0, a1" in error["message"]
    base = httpx.get(srv.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    for path, body in calls:  # the base model is no adapter: named as such, not as unknown
        response = httpx.post(srv.url + path, json={"lora_name": base, **body}, headers=AUTH, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_request"
        assert "is the base model, not an adapter" in response.json()["error"]["message"]


def test_a_model_card_answers_to_every_name_a_request_takes(lora_server):
    srv, adapters = lora_server
    base = httpx.get(srv.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    for name in ("a0", f"{base}:a0", str(adapters["a0"]), str(adapters["a0"]) + "/"):
        card = httpx.get(f"{srv.url}/v1/models/{name}", headers=AUTH)
        assert card.status_code == 200 and card.json()["id"] == "a0", (name, card.text)
        tokenized = httpx.post(srv.url + "/tokenize", headers=AUTH, json={"model": name, "prompt": "hi"})
        assert tokenized.status_code == 200, (name, tokenized.text)
    assert httpx.get(f"{srv.url}/v1/models/{base}:nope", headers=AUTH).status_code == 404


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as strict JSON clients do."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in a response: not JSON"))


def test_an_adapter_that_overflows_the_activations_gives_null_logprobs_not_errors(lora_server):
    """Finite weights with an absurd scale pass the loader's finiteness check, and the logits of its requests are
    NaN: their logprobs are null, every response stays valid JSON, and base requests are unchanged."""
    srv, adapters = lora_server
    prompt = {"text": "Hello, world!", "return_logprob": True, "logprob_start_len": 0, "sampling_params": GREEDY}
    base_before = generate(srv.url, None)
    tensors, config = body_of(adapters["a0"])
    body = {"lora_name": "overflow", "tensors": tensors, "config": {**config, "lora_alpha": 3e38}}
    loaded = httpx.post(srv.url + "/load_lora_adapter_from_tensors", json=body, headers=AUTH, timeout=60)
    assert loaded.status_code == 200, loaded.text
    response = httpx.post(srv.url + "/generate", headers=AUTH, timeout=60, json={**prompt, "lora_path": "overflow"})
    assert response.status_code == 200, response.text
    meta = strict_json(response.text)["meta_info"]
    assert None in [lp for lp, _ in meta["output_token_logprobs"]]  # the logits were not finite
    with httpx.stream(
        "POST",
        srv.url + "/generate",
        headers=AUTH,
        timeout=60,
        json={**prompt, "lora_path": "overflow", "stream": True},
    ) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: {")]
    assert events and all(strict_json(event)["meta_info"] for event in events)
    completion = httpx.post(
        srv.url + "/v1/completions",
        headers=AUTH,
        timeout=60,
        json={"model": "overflow", "prompt": "Hello", "max_tokens": 4, "logprobs": 2, "echo": True},
    )
    assert completion.status_code == 200, completion.text
    assert strict_json(completion.text)["choices"][0]["logprobs"]["token_logprobs"]
    assert generate(srv.url, None)["output_ids"] == base_before["output_ids"]
