"""Multi-host serving on CPU: two real processes of two fake devices each, tp 4 across them (gloo collectives).

Node 0 (`launch --nnodes 2 --node-rank 0`) serves HTTP on 127.0.0.1; node 1 replays its steps. Greedy tokens and
logprobs must equal a single-process tp-4 engine and HF transformers + PEFT, with adapters mixed with base requests,
adapters loaded and unloaded while the nodes run, and no compilation after warmup on either node. Killing one node
must make the other exit non-zero, and node 0's pending request must get an error. Two nodes serving a checkpoint
converted with orbax (each restoring its own shards) give the single engine's tokens too.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from sgl_jax_lora import Engine
from sgl_jax_lora.convert import convert
from tests.support.http_helpers import ServerProcess, free_port, server_env
from tests.support.model_fixtures import load_hf_model, make_hf_model_dir
from tests.support.peft_fixtures import load_peft_model, write_peft_adapter

SMALL = dict(
    dtype="float32",
    context_length=128,
    max_running_requests=8,
    chunked_prefill_size=32,
    max_prefill_seqs=4,
    token_buckets=[16],
    max_loras_per_batch=2,
    lora_backend="sgmv",
    tp_size=4,
    decode_step_programs="on",  # off by default on CPU: the followers compile and run the decode steps' programs too
)
GREEDY = {"temperature": 0.0, "ignore_eos": True}
LOGPROB_ATOL = 1e-4  # float32 against HF + PEFT on CPU, as in test_lora_engine.py
EXIT_DEADLINE_S = 120  # a node that should exit has hung if it has not after this long (heartbeat timeout: 5 s)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    base = make_hf_model_dir(root / "base", "llama", seed=5, num_attention_heads=8, head_dim=6)
    adapters = {
        "a": write_peft_adapter(base, root / "a", seed=1, r=8, lora_alpha=16, target_modules="all-linear"),
        "b": write_peft_adapter(
            base, root / "b", seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
        "c": write_peft_adapter(
            base, root / "c", seed=3, r=8, lora_alpha=8, target_modules=["o_proj", "gate_proj", "up_proj"]
        ),
    }
    return root, base, adapters


def cli_flags(settings: dict) -> list[str]:
    flags = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def fake_cpu_devices(rank: int) -> dict:
    return {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


class Cluster:
    """Two nodes on 127.0.0.1, each in its own process group; `node_devices(rank)` is the environment that gives a
    node its devices (two fake CPU devices each by default)."""

    def __init__(self, base, adapters: dict, allowed_dir, node_devices=fake_cpu_devices, settings=SMALL, **extra):
        coordinator = free_port()
        settings = {
            **settings,
            "model_path": base,
            "nnodes": 2,
            "dist_init_addr": f"127.0.0.1:{coordinator}",
            "dist_heartbeat_timeout": 5,
            "lora_paths": [f"a={adapters['a']}", f"b={adapters['b']}"],
            "lora_allowed_dirs": allowed_dir,
            **extra,
        }
        self.nodes = []
        for rank in range(2):
            port = free_port()
            env = {**server_env(), **node_devices(rank)}
            node = ServerProcess([*cli_flags(settings), "--node-rank", str(rank), "--port", str(port)], port, env=env)
            self.nodes.append(node)

    def wait_healthy(self) -> None:
        for node in self.nodes:
            node.wait_healthy(600)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(setup):
    root, base, adapters = setup
    nodes = Cluster(base, adapters, root)
    try:
        nodes.wait_healthy()
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def single(setup):
    """The same engine in one process (tp 4 over 4 of this process's 8 fake devices)."""
    _, base, adapters = setup
    with Engine(
        model_path=str(base), lora_paths={n: str(adapters[n]) for n in ("a", "b")}, skip_precompile=True, **SMALL
    ) as engine:
        yield engine


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 491, size=length).tolist()


def generate(node: ServerProcess, ids: list, loras: list, max_new_tokens: int) -> list[dict]:
    body = {
        "input_ids": ids,
        "lora_path": loras,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY},
    }
    response = httpx.post(node.url + "/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def single_engine(single: Engine, ids: list, loras: list, max_new_tokens: int) -> list[dict]:
    """The single-process engine's greedy results for the same prompts, with every logprob."""
    return single.generate(
        input_ids=ids,
        lora_path=loras,
        return_logprob=True,
        logprob_start_len=0,
        sampling_params={"max_new_tokens": max_new_tokens, **GREEDY},
    )


def reference(base, adapter_dir, ids: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """HF (+ PEFT) greedy tokens and prompt logprobs."""
    model = load_peft_model(base, adapter_dir) if adapter_dir else load_hf_model(base)
    with torch.no_grad():
        tokens = torch.tensor([ids])
        logprobs = torch.log_softmax(model(tokens).logits[0], -1)[:-1].gather(1, tokens[0, 1:, None])[:, 0].numpy()
        generated = list(ids)
        for _ in range(max_new_tokens):
            generated.append(int(model(torch.tensor([generated])).logits[0, -1].argmax()))
    return generated[len(ids) :], logprobs


def logprobs_of(out: dict, key: str) -> np.ndarray:
    return np.array([lp if lp is not None else 0.0 for lp, *_ in out["meta_info"][key]])


def assert_same_as(ours: list[dict], theirs: list[dict]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            # float32; a row batched with other rows runs another bucket's program, whose sums may differ by a few
            # ulp (1.2e-6 seen at a logprob of -3.7)
            np.testing.assert_allclose(logprobs_of(a, key), logprobs_of(b, key), rtol=0, atol=1e-5)


def assert_matches_peft(base, adapters: dict, loras: list, ids: list, outs: list[dict], max_new_tokens: int) -> None:
    for name, p, out in zip(loras, ids, outs, strict=True):
        tokens, logprobs = reference(base, adapters[name] if name else None, p, max_new_tokens)
        assert out["output_ids"] == tokens, name
        assert np.abs(logprobs_of(out, "input_token_logprobs")[1:] - logprobs).max() < LOGPROB_ATOL, name


def compilations_after_warmup(cluster: Cluster) -> list[int]:
    leader = httpx.get(cluster.nodes[0].url + "/get_server_info", timeout=30).json()
    follower = httpx.get(cluster.nodes[1].url + "/health", timeout=30).json()
    return [leader["num_compilations_after_warmup"], follower["num_compilations_after_warmup"]]


@pytest.mark.slow
def test_two_nodes_equal_one_process_and_peft_with_adapters_mixed_with_base(cluster, single, setup):
    _, base, adapters = setup
    loras = ["a", None, "b", None, "a"]
    ids = [prompt(i, 9 + 3 * i) for i in range(len(loras))]
    outs = generate(cluster.nodes[0], ids, loras, 6)
    expected = single_engine(single, ids, loras, 6)
    assert_same_as(outs, expected)
    assert_matches_peft(base, adapters, loras, ids, outs, 6)
    info = httpx.get(cluster.nodes[0].url + "/get_server_info", timeout=30).json()
    assert len(info["devices"]) == 4
    assert compilations_after_warmup(cluster) == [0, 0]


def test_logit_adjustments_reach_every_node(cluster, single):
    # penalties are packed on node 0's host and applied on every node's devices: the packed entries travel
    ids = [prompt(60 + i, 12) for i in range(2)]
    params = {
        "max_new_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "frequency_penalty": 1.5,
        "repetition_penalty": 1.3,
    }
    response = httpx.post(
        cluster.nodes[0].url + "/generate",
        json={"input_ids": ids, "lora_path": ["b", None], "sampling_params": params, "return_logprob": True},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    expected = single.generate(input_ids=ids, lora_path=["b", None], sampling_params=params, return_logprob=True)
    assert_same_as(response.json(), expected)
    plain = single.generate(
        input_ids=ids,
        lora_path=["b", None],
        sampling_params={**params, "frequency_penalty": 0.0, "repetition_penalty": 1.0},
    )
    assert [o["output_ids"] for o in plain] != [o["output_ids"] for o in expected]  # the penalties changed the tokens
    assert compilations_after_warmup(cluster) == [0, 0]


def test_follower_answers_health_only(cluster):
    follower = cluster.nodes[1].url
    assert httpx.get(follower + "/health", timeout=30).json()["status"] == "ok"
    refused = httpx.post(follower + "/generate", json={"text": "hi"}, timeout=30)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"  # the server's error body
    assert "the routes of this server: /health" in refused.json()["error"]["message"]


def test_adapter_load_and_unload_while_the_nodes_run(cluster, single, setup):
    root, base, adapters = setup
    leader = cluster.nodes[0].url
    response = httpx.post(
        leader + "/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])}, timeout=120
    )
    assert response.status_code == 200, response.text
    single.load_lora_adapter("c", str(adapters["c"]))
    # three adapters over two device slots: slots are evicted and rewritten on both nodes
    loras = ["c", "a", None, "b", "c"]
    ids = [prompt(40 + i, 8 + 2 * i) for i in range(len(loras))]
    outs = generate(cluster.nodes[0], ids, loras, 5)
    expected = single_engine(single, ids, loras, 5)
    assert_same_as(outs, expected)
    assert_matches_peft(base, adapters, loras[:1], ids[:1], outs[:1], 5)
    response = httpx.post(leader + "/unload_lora_adapter", json={"lora_name": "a"}, timeout=120)
    assert response.status_code == 200, response.text
    refused = httpx.post(leader + "/generate", json={"input_ids": ids[0], "lora_path": "a"}, timeout=60)
    assert 400 <= refused.status_code < 500, refused.text
    after = generate(cluster.nodes[0], ids[2:4], [None, "b"], 5)
    assert_same_as(after, expected[2:4])
    # an in-memory update: adapter b gets c's tensors and config; both nodes serve c's weights under b's name
    update = {
        "lora_name": "b",
        "tensors": base64.b64encode((adapters["c"] / "adapter_model.safetensors").read_bytes()).decode(),
        "config": json.loads((adapters["c"] / "adapter_config.json").read_text()),
    }
    response = httpx.post(leader + "/update_lora_adapter", json=update, timeout=120)
    assert response.status_code == 200, response.text
    updated = generate(cluster.nodes[0], ids[:1], ["b"], 5)
    assert_matches_peft(base, adapters, ["c"], ids[:1], updated, 5)
    assert compilations_after_warmup(cluster) == [0, 0]


@pytest.mark.slow
def test_stopped_follower_exits_and_makes_node_0_exit_and_fail_its_request(cluster):
    """SIGTERM (an operator's or a supervisor's stop) ends a follower at once, though JAX's runtime would catch it."""
    # runs last in this module: it ends the cluster
    leader, follower = cluster.nodes
    result: dict = {}

    def pending_request() -> None:
        body = {"input_ids": prompt(90, 10), "sampling_params": {"max_new_tokens": 100, **GREEDY}}
        try:
            result["response"] = httpx.post(leader.url + "/generate", json=body, timeout=EXIT_DEADLINE_S)
        except httpx.TransportError as e:
            result["error"] = e

    thread = threading.Thread(target=pending_request)
    thread.start()
    wait_until_running(leader)
    follower.process.send_signal(signal.SIGTERM)
    assert follower.process.wait(timeout=EXIT_DEADLINE_S) == -signal.SIGTERM
    code = leader.process.wait(timeout=EXIT_DEADLINE_S)
    thread.join(timeout=EXIT_DEADLINE_S)
    assert code != 0
    assert result["response"].status_code >= 500, result["response"].text


@pytest.mark.slow  # a second pair of nodes: their start takes most of a minute on two cores
def test_two_nodes_serve_a_converted_checkpoint_and_a_killed_node_0_ends_the_follower(setup, single):
    """Each node restores its own shards of an orbax checkpoint converted for tp 4; then node 0 dies."""
    root, base, adapters = setup
    converted = convert(str(base), str(root / "converted-tp4"), tp_size=4, dtype="float32")
    nodes = Cluster(converted, adapters, root, skip_precompile=True)
    try:
        nodes.wait_healthy()
        leader, follower = nodes.nodes
        loras = ["a", None, "b"]
        ids = [prompt(70 + i, 7 + 4 * i) for i in range(len(loras))]
        expected = single_engine(single, ids, loras, 5)
        assert_same_as(generate(leader, ids, loras, 5), expected)
        _kill_with_children(leader.process)
        assert follower.process.wait(timeout=EXIT_DEADLINE_S) != 0
    finally:
        nodes.stop()


def num_cuda_devices() -> int:
    """GPUs on this host, counted without starting a CUDA client in the test process (it would hold their memory)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    listing = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False).stdout
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def one_gpu_each(rank: int) -> dict:
    return {"CUDA_VISIBLE_DEVICES": str(rank), "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off


# a model shaped for the GPU kernels (head_dim 128, projections multiples of 128), bf16, tp 2
GPU_MODEL = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=128)
GPU_SETTINGS = {**SMALL, "dtype": "bfloat16", "tp_size": 2, "lora_backend": "auto", "max_total_tokens": 4096}
BF16_LOGPROB_ATOL = 0.05  # two bf16 programs whose all-reduces run in different process layouts


@pytest.mark.gpu
@pytest.mark.skipif(num_cuda_devices() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("source", ["hf", "converted"])
def test_two_gpu_processes_equal_one_process_tp2(tmp_path, monkeypatch, source):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the engines of this test share the two GPUs
    base = make_hf_model_dir(tmp_path / "base", "llama", seed=7, **GPU_MODEL)
    served = base  # the nodes serve the HF directory, or its orbax conversion for tp 2 (each node restores its shards)
    if source == "converted":
        served = convert(str(base), str(tmp_path / "converted"), tp_size=2, dtype=GPU_SETTINGS["dtype"])
    adapters = {
        "a": write_peft_adapter(base, tmp_path / "a", seed=1, r=8, lora_alpha=16, target_modules="all-linear"),
        "b": write_peft_adapter(base, tmp_path / "b", seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    }
    loras = ["a", None, "b", None, "a", "b"]
    ids = [prompt(100 + i, 9 + 5 * i) for i in range(len(loras))]
    params = {"max_new_tokens": 8, **GREEDY}
    lora_paths = {n: str(adapters[n]) for n in ("a", "b")}
    with Engine(model_path=str(base), lora_paths=lora_paths, skip_precompile=True, **GPU_SETTINGS) as single:
        expected = single.generate(
            input_ids=ids, lora_path=loras, return_logprob=True, logprob_start_len=0, sampling_params=params
        )
        assert len(single.get_server_info()["devices"]) == 2
    nodes = Cluster(served, adapters, tmp_path, node_devices=one_gpu_each, settings=GPU_SETTINGS)
    try:
        nodes.wait_healthy()
        outs = generate(nodes.nodes[0], ids, loras, 8)
        assert compilations_after_warmup(nodes) == [0, 0]
    finally:
        nodes.stop()
    for ours, theirs in zip(outs, expected, strict=True):
        assert ours["output_ids"] == theirs["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            gap = np.abs(logprobs_of(ours, key) - logprobs_of(theirs, key)).max()
            print(f"two processes vs one, {key}: max |logprob difference| {gap:.2e}")
            assert gap < BF16_LOGPROB_ATOL, key


def wait_until_running(node: ServerProcess) -> None:
    """Poll (bounded) until the node's engine runs a request."""
    deadline = time.monotonic() + EXIT_DEADLINE_S
    while httpx.get(node.url + "/get_server_info", timeout=30).json()["num_running"] == 0:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.05)  # poll interval of a bounded wait


def _kill_with_children(process: subprocess.Popen) -> None:
    """SIGKILL a launched node 0 and its engine process (the whole node dies at once)."""
    children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    process.kill()
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
