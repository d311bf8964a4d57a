"""A quiet start (utils/quiet.py): the launcher, run where torch is not installed (as after
`pip install -e .`: torch is a test dependency only), prints neither transformers' "PyTorch was not found"
nor JAX's "Unable to initialize backend 'tpu'" nor, where libtpu is installed on a host without a TPU (the test
extra installs it), libtpu's probe lines, and still prints the listening address first and the ready line last. JAX's warnings are untouched: with --log-level debug the probing lines come back.

The torch-less interpreter is this one with `-S` (no site-packages) and a PYTHONPATH folder that links
every installed package but torch's; the engine process inherits both. A control run shows that
interpreter prints the transformers message unless the filter is installed.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import site
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.http_helpers import SMALL_ENGINE_FLAGS, server_env, start_server

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

REPO = REPO_ROOT
TORCH_ENTRIES = ("torch", "functorch", "torchgen")
LIBTPU_PROBE = ("Failed to find host bounds", "TPU_WORKER_HOSTNAMES")  # libtpu's C++ lines on a host without a TPU
PROBE_SETTINGS = ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY", "TPU_LIBRARY_PATH")
NOISE = ("PyTorch was not found", "Unable to initialize backend", *LIBTPU_PROBE)


@pytest.fixture(scope="module")
def torchless_env(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("site-without-torch")
    for site_dir in site.getsitepackages():
        for entry in os.listdir(site_dir):
            name = entry.split("-")[0]
            if entry.endswith(".pth") or name in TORCH_ENTRIES or entry.startswith(("torch-", "torch_")):
                continue
            link = folder / entry
            if not link.exists():
                link.symlink_to(os.path.join(site_dir, entry))
    env = server_env()
    env["PYTHONPATH"] = os.pathsep.join([REPO, str(folder)])
    env["PYTHONNOUSERSITE"] = "1"
    return env


def run_python(env: dict, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )


def test_the_environment_has_no_torch_and_transformers_says_so(torchless_env):
    probe = run_python(torchless_env, "import importlib.util; print(importlib.util.find_spec('torch'))")
    assert probe.stdout.strip() == "None", probe.stderr
    loud = run_python(torchless_env, "import transformers")
    assert "PyTorch was not found" in loud.stderr  # what a bare machine shows without the filter
    quiet = run_python(
        torchless_env,
        "from sgl_jax_lora.utils.quiet import quiet_platform_probes; quiet_platform_probes(); import transformers",
    )
    assert quiet.returncode == 0, quiet.stderr
    assert "PyTorch was not found" not in quiet.stderr


def test_jax_probe_lines_dropped_unless_debug(torchless_env):
    code = (
        "import logging, sys; logging.basicConfig(level='INFO'); from sgl_jax_lora.utils.quiet import quiet_platform_probes; "
        "quiet_platform_probes(sys.argv[1]); import jax; jax.devices()"
    )
    env = {**torchless_env, "JAX_PLATFORMS": ""}
    info = subprocess.run(
        [sys.executable, "-S", "-c", code, "info"], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    debug = subprocess.run(
        [sys.executable, "-S", "-c", code, "debug"], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert info.returncode == 0 and debug.returncode == 0, info.stderr + debug.stderr
    assert "Unable to initialize backend" not in info.stderr
    assert "Unable to initialize backend" in debug.stderr  # the line exists on this machine: the check above can fail


def tpu_chips_on_this_host() -> int:
    from jax._src import hardware_utils

    return hardware_utils.num_available_tpu_chips_and_device_id()[0]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
@pytest.mark.skipif(tpu_chips_on_this_host() > 0, reason="a TPU host: its probe finds chips")
def test_libtpu_probe_skipped_without_a_chip_and_tpu_lowering_kept(torchless_env):
    code = (
        "import sys; from sgl_jax_lora.utils.quiet import skip_tpu_probe_without_chips; "
        "skipped = sys.argv[1] == 'skip' and skip_tpu_probe_without_chips(); "
        "import flax, jax, jax.numpy as jnp; print(skipped, jax.devices()[0].platform); "
        "jax.export.export(jax.jit(lambda x: x + 1), platforms=['tpu'])(jax.ShapeDtypeStruct((8, 128), jnp.float32))"
    )
    # as on a bare shell (JAX in this test process set the variables that keep libtpu from querying the host), and
    # libtpu loads though another test process may hold its lock (then it would give up before printing)
    env = {key: value for key, value in torchless_env.items() if key not in PROBE_SETTINGS}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    runs = {
        mode: subprocess.run(
            [sys.executable, "-S", "-c", code, mode], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
        )
        for mode in ("skip", "probe")
    }
    for run in runs.values():
        assert run.returncode == 0, run.stderr  # the TPU platform stays known: flax's and the export's TPU lowering
    assert runs["skip"].stdout.split()[0] == "True"
    assert not any(line in runs["skip"].stderr for line in LIBTPU_PROBE), runs["skip"].stderr
    assert any(line in runs["probe"].stderr for line in LIBTPU_PROBE)  # the lines exist here: the check can fail


def test_launcher_start_is_quiet_and_ordered(torchless_env):
    server = start_server(SMALL_ENGINE_FLAGS, timeout_s=900, python_args=["-S"], env=torchless_env)
    try:
        server.stop(signal.SIGTERM)
        log = server.log_text()
    finally:
        server.stop(signal.SIGKILL)
    for noise in NOISE:
        assert noise not in log, log[-3000:]
    listening = log.index("listening on http://127.0.0.1:")
    ready = log.index("sgl_jax_lora ready:")
    assert listening < ready
    assert log.index("demo model") < ready
    assert "trained on a small corpus" in log[listening:ready]  # what the demo model is
