"""Weight loading at startup: an HF safetensors directory against the converted orbax checkpoint of the same
weights, side by side (docs/checkpoints.md; the result goes to docs/benchmarks.md, "Startup").

1. Writes an HF directory of random bf16 weights (normal, std 0.02) in several safetensors shards with an index,
   as real checkpoints come, for the --preset shape (default Llama-3-8B: ~16 GB; `tiny` runs on CPU in seconds).
2. Converts it with `python -m sgl_jax_lora.convert` (timed once).
3. For each repeat and each page-cache state (`cold`: the files' pages dropped with posix_fadvise DONTNEED first;
   `warm`: read through once first), starts a fresh Python process per path that builds the mesh and calls
   load_model_state, then blocks until every weight is on the devices. Reported per run: seconds from the
   parent's spawn to that point (`total_s`; Python and JAX start-up included), the part inside load_model_state
   (`load_s`), and the fraction of the files' pages that were in the OS page cache when the run started (mincore),
   so a `cold` run whose pages could not be dropped shows it. A position-weighted checksum of the loaded weights
   must agree between the two paths.

    python scripts/bench_startup_orbax.py --out startup_orbax.json [--tp-size 1] [--repeats 3] [--work-dir /tmp]
    python scripts/bench_startup_orbax.py --preset tiny --repeats 1 --out tiny.json      # CPU smoke run

Disk: one HF copy and one orbax copy of the weights under --work-dir (about 2 x 16 GB for the default), removed at
the end unless --keep.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sgl_jax_lora.demo_model import demo_model_path  # noqa: E402

_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
PRESETS = {
    "llama3-8b": {
        **_SHAPE,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
    },
    "tiny": {
        **_SHAPE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 491,
    },
}

_CHILD = """
import json, sys, time
start = float(sys.argv[4])
import jax, jax.numpy as jnp
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.models.weight_loader import load_model_state
path, tp, dtype = sys.argv[1], int(sys.argv[2]), jnp.dtype(sys.argv[3])
mesh = make_mesh(tp)
imported = time.time()
_, state = load_model_state(ModelConfig.from_model_path(path), tp, 16, dtype, mesh, None)
jax.block_until_ready(state)
done = time.time()
def checksum(x):  # position-weighted, so a permuted or mispacked tensor changes it
    x = x.reshape(-1, x.shape[-1])
    cols = jnp.cos(jnp.arange(x.shape[1], dtype=jnp.float32)).astype(x.dtype)
    rows = jnp.cos(0.7 * jnp.arange(x.shape[0], dtype=jnp.float32))
    return jnp.dot(rows, jnp.einsum("re,e->r", x, cols, preferred_element_type=jnp.float32))
total = sum(float(jax.jit(checksum)(leaf)) for leaf in jax.tree_util.tree_leaves(state))
print("RESULT " + json.dumps({"total_s": done - start, "startup_s": imported - start, "load_s": done - imported,
                              "checksum": total, "device": jax.devices()[0].device_kind}), flush=True)
"""


def hf_tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes, in file order."""
    e, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = [("model.embed_tokens.weight", (v, e))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (q, e)),
            (p + "self_attn.k_proj.weight", (kv, e)),
            (p + "self_attn.v_proj.weight", (kv, e)),
            (p + "self_attn.o_proj.weight", (e, q)),
            (p + "mlp.gate_proj.weight", (f, e)),
            (p + "mlp.up_proj.weight", (f, e)),
            (p + "mlp.down_proj.weight", (e, f)),
            (p + "input_layernorm.weight", (e,)),
            (p + "post_attention_layernorm.weight", (e,)),
        ]
    return shapes + [("model.norm.weight", (e,)), ("lm_head.weight", (v, e))]


def write_hf_dir(path: str, cfg: dict, num_shards: int, seed: int = 0) -> int:
    """config.json, the demo tokenizer and random bf16 safetensors shards + index; -> bytes of weights."""
    from safetensors.numpy import save_file

    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(demo_model_path(), name), path)
    rng = np.random.default_rng(seed)
    # Tensors are cut from a 128 MB pool of normal values at random offsets: drawing 8e9 normals would take minutes,
    # and repeats 64 MB apart are far outside the window of orbax's zstd, so they do not compress better than real ones.
    shapes = hf_tensor_shapes(cfg)
    pool_size = min(1 << 26, 2 * max(int(np.prod(s)) for _, s in shapes))
    pool = (0.02 * rng.standard_normal(pool_size, dtype=np.float32)).astype(ml_dtypes.bfloat16)
    total = sum(2 * int(np.prod(s)) for _, s in shapes)
    groups, group_bytes = [[]], 0
    for name, shape in shapes:
        if group_bytes >= total / num_shards and len(groups) < num_shards:
            groups, group_bytes = groups + [[]], 0
        groups[-1].append((name, shape))
        group_bytes += 2 * int(np.prod(shape))
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _from_pool(pool, int(np.prod(shape)), rng).reshape(shape) for name, shape in group}
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _from_pool(pool: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    piece = len(pool) // 2
    parts = [
        pool[start : start + min(piece, size - done)]
        for done, start in ((d, int(rng.integers(0, piece))) for d in range(0, size, piece))
    ]
    return np.concatenate(parts)


def files_under(path: str) -> list[str]:
    return sorted(os.path.join(root, n) for root, _, names in os.walk(path) for n in names)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in files_under(path))


def drop_from_page_cache(path: str) -> None:
    """Ask the kernel to drop the files' clean cached pages (no root needed; advisory)."""
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_through(path: str) -> None:
    for name in files_under(path):
        with open(name, "rb") as f:
            while f.read(1 << 24):
                pass


def resident_fraction(path: str) -> float:
    """Fraction of the files' pages in the OS page cache (mincore over a read-only mapping of each file)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = pages = 0
    for name in files_under(path):
        size = os.path.getsize(name)
        if size == 0:
            continue
        fd = os.open(name, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            count = (size + page - 1) // page
            vec = (ctypes.c_ubyte * count)()
            if libc.mincore(addr, size, vec) == 0:
                resident += sum(b & 1 for b in bytes(vec))
                pages += count
            libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / pages if pages else 0.0


def timed_load(path: str, tp: int, dtype: str) -> dict:
    """One fresh process: start -> weights on the devices."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, path, str(tp), dtype, repr(time.time())],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    result = next((line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        raise SystemExit(f"loading {path} failed:\n{proc.stderr[-3000:]}")
    return json.loads(result)


def measure(
    paths: dict[str, str], tp: int, repeats: int, caches: list[str], on_run: Callable[[list[dict]], None]
) -> list[dict]:
    """Runs in the order hf, orbax, hf, orbax, ... for each cache state of each repeat; on_run(runs) after each."""
    runs = []
    for repeat in range(repeats):
        for cache in caches:
            for kind, path in paths.items():
                (drop_from_page_cache if cache == "cold" else read_through)(path)
                resident = resident_fraction(path)
                run = {
                    "path": kind,
                    "cache": cache,
                    "repeat": repeat,
                    "resident_fraction": round(resident, 4),
                    **timed_load(path, tp, "bfloat16"),
                }
                runs.append(run)
                print(json.dumps(run), flush=True)
                on_run(runs)
    return runs


def summarize(runs: list[dict]) -> dict:
    """Median total_s per path and cache state, and orbax / hf."""
    summary = {}
    for cache in sorted({r["cache"] for r in runs}):
        median = {
            kind: statistics.median(r["total_s"] for r in runs if r["cache"] == cache and r["path"] == kind)
            for kind in ("hf", "orbax")
        }
        summary[cache] = {
            "hf_total_s": median["hf"],
            "orbax_total_s": median["orbax"],
            "orbax_over_hf": median["orbax"] / median["hf"],
        }
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    parser.add_argument(
        "--num-layers", type=int, default=None, help="override the preset's decoder layers (a shorter run)"
    )
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--caches", default="cold,warm", help="page-cache states to run, in order: cold, warm")
    parser.add_argument("--num-shards", type=int, default=4, help="safetensors files of the HF directory")
    parser.add_argument(
        "--work-dir", default=None, help="where the two copies are written (default: the system temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the written directories")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(argv)
    cfg = {**PRESETS[opts.preset], **({"num_hidden_layers": opts.num_layers} if opts.num_layers else {})}
    root = tempfile.mkdtemp(prefix="bench-startup-orbax-", dir=opts.work_dir)
    paths = {"hf": os.path.join(root, "hf"), "orbax": os.path.join(root, "orbax")}
    result = {
        "argv": sys.argv[1:] if argv is None else argv,
        "preset": opts.preset,
        "num_layers": cfg["num_hidden_layers"],
        "tp_size": opts.tp_size,
    }

    def write_out(runs: list[dict]) -> None:  # after every run, so a run cut short still leaves its results
        result["runs"] = runs
        if opts.out:
            with open(opts.out, "w") as f:
                json.dump(result, f, indent=2)

    try:
        start = time.perf_counter()
        result["weight_bytes"] = write_hf_dir(paths["hf"], cfg, opts.num_shards)
        result["write_hf_s"] = time.perf_counter() - start
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "sgl_jax_lora.convert",
                "--model-path",
                paths["hf"],
                "--output-dir",
                paths["orbax"],
                "--tp-size",
                str(opts.tp_size),
                "--dtype",
                "bfloat16",
            ],
            check=True,
            cwd=ROOT,
        )
        result["convert_s"] = time.perf_counter() - start
        result.update(hf_dir_bytes=dir_bytes(paths["hf"]), orbax_dir_bytes=dir_bytes(paths["orbax"]))
        runs = measure(paths, opts.tp_size, opts.repeats, opts.caches.split(","), write_out)
        checksums = {r["path"]: r["checksum"] for r in runs}
        result.update(
            device=runs[0]["device"],
            summary=summarize(runs),
            checksums_agree=bool(np.isclose(checksums["hf"], checksums["orbax"], rtol=1e-5, atol=1e-6)),
        )
        write_out(runs)
    finally:
        if not opts.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({k: result[k] for k in ("device", "convert_s", "checksums_agree", "summary")}, indent=2))
    return result


if __name__ == "__main__":
    main()
