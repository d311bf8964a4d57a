"""The decoder layers' base GEMMs as the Mosaic GPU kernel in large token buckets (`--gpu-gemm-min-tokens`;
layers/base_gemm.py, pallas_kernels/sgmv/gemm_gpu.py).

On CPU a positive threshold computes that path with the kernel's pure-JAX reference, so what is checked here is
everything around the kernel: which buckets and modules take it (the model keeps the base weights as whole stacks
outside its layer scan in those buckets), tensor parallelism (row-parallel modules all-reduce their partial
products), LoRA steps around it, the flag's validation and its way from the server args to the model. On a Hopper
GPU the same tests run the kernel itself when JAX is left on the GPU (`JAX_PLATFORMS=cuda`; a plain run of the suite
keeps JAX on the CPU, tests/conftest.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sgl_jax_lora.layers.base_gemm as base_gemm_module
import sgl_jax_lora.lora.backend.pallas_gpu as pallas_gpu_module
from sgl_jax_lora.layers.base_gemm import DEFAULT_MIN_TOKENS, BaseGemm, make_base_gemm
from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.models.llama import LINEAR_AXES
from sgl_jax_lora.server_args import ServerArgs
from tests.support.kernel_sized_engine import count_calls, make_kernel_sized_model, serve_logprobs
from tests.support.model_forward import model_logits
from tests.support.peft_fixtures import write_peft_adapter

THRESHOLD = 256


@pytest.fixture(scope="module")
def kernel_sized_model(tmp_path_factory):
    return make_kernel_sized_model(tmp_path_factory.mktemp("basegemm") / "base")


def forward_logits(model_dir, num_tokens: int, min_tokens: int, tp_size: int) -> np.ndarray:
    ids = np.random.default_rng(num_tokens).integers(2, 491, num_tokens)
    return model_logits(model_dir, ids, jnp.bfloat16, tp_size, base_gemm_min_tokens=min_tokens)


@pytest.mark.parametrize(
    "tp_size,num_tokens,kernel_calls",
    [
        (1, 256, 4),  # q|k|v, o, gate|up and down, traced once in the layer scan
        (1, 8, 0),  # below the threshold: XLA's dot
        (2, 256, 3),  # q|k|v's 384 columns per shard do not fit the kernel's 256-column tiles: XLA's dot
    ],
)
def test_forward_with_the_base_gemm_kernel_equals_xla_dot(
    kernel_sized_model, monkeypatch, tp_size, num_tokens, kernel_calls
):
    """Each module the kernel takes is one call; gate|up's is the gated one (silu(gate) * up in its epilogue)."""
    if tp_size > len(jax.devices()):
        pytest.skip(f"needs {tp_size} devices (CPU tests fake them)")
    gated, real = [], base_gemm_module.gemm_gpu

    def recorded(*args, **kwargs):
        gated.append(kwargs.get("gated", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(base_gemm_module, "gemm_gpu", recorded)
    expected = forward_logits(kernel_sized_model, num_tokens, 0, tp_size)
    assert not gated
    ours = forward_logits(kernel_sized_model, num_tokens, THRESHOLD, tp_size)
    assert len(gated) == kernel_calls and sum(gated) == (1 if kernel_calls else 0)
    assert np.abs(ours - expected).max() <= 4e-2 * np.abs(expected).max()  # bf16 rounding (measured: 0.9-1.7%)


def test_a_padded_bucket_gives_the_kernel_its_real_rows(kernel_sized_model, monkeypatch):
    """200 tokens padded to the 256 bucket: each kernel call is told the step's 200 real rows (the GPU kernel skips
    the padding's row tiles, zero in its output), and the real tokens' logits are those of XLA's dot over the
    padded bucket."""
    rows_seen, real = [], base_gemm_module.gemm_gpu

    def recorded(x, stack, layer, num_rows, **kwargs):
        jax.debug.callback(lambda rows: rows_seen.append(int(rows[0])), num_rows)
        return real(x, stack, layer, num_rows, **kwargs)

    monkeypatch.setattr(base_gemm_module, "gemm_gpu", recorded)
    ids = np.random.default_rng(7).integers(2, 491, 200)
    expected = model_logits(kernel_sized_model, ids, jnp.bfloat16, bucket=256, base_gemm_min_tokens=0)
    assert not rows_seen
    ours = model_logits(kernel_sized_model, ids, jnp.bfloat16, bucket=256, base_gemm_min_tokens=THRESHOLD)
    assert rows_seen and set(rows_seen) == {200}  # q|k|v, o, gate|up and down of every layer
    assert np.abs(ours - expected).max() <= 4e-2 * np.abs(expected).max()


def test_the_skinny_form_takes_the_smallest_kernel_bucket(kernel_sized_model, monkeypatch):
    """With the skinny form on (the default on one Hopper GPU), a bucket of at most SKINNY_MAX_TOKENS among the
    kernel's buckets runs every module through `gemm_skinny_gpu` (gate|up's activation after it), told the step's real
    rows; the real tokens' logits are those of XLA's dot. On CPU the kernel's pure-JAX reference stands in."""
    import sgl_jax_lora.models.weight_loader as weight_loader

    monkeypatch.setattr(
        weight_loader, "make_base_gemm", lambda min_tokens, mesh: BaseGemm(256, mesh, reference=True, skinny=True)
    )
    rows_seen, plain, real = [], [], base_gemm_module.gemm_skinny_gpu

    def recorded(x, stack, layer, num_rows, **kwargs):
        jax.debug.callback(lambda rows: rows_seen.append(int(rows[0])), num_rows)
        return real(x, stack, layer, num_rows, **kwargs)

    monkeypatch.setattr(base_gemm_module, "gemm_skinny_gpu", recorded)
    monkeypatch.setattr(base_gemm_module, "gemm_gpu", lambda *args, **kwargs: plain.append(1))
    ids = np.random.default_rng(9).integers(2, 491, 200)
    ours = model_logits(kernel_sized_model, ids, jnp.bfloat16, bucket=256, base_gemm_min_tokens=THRESHOLD)
    assert rows_seen and set(rows_seen) == {200} and not plain
    monkeypatch.undo()
    expected = model_logits(kernel_sized_model, ids, jnp.bfloat16, bucket=256, base_gemm_min_tokens=0)
    assert np.abs(ours - expected).max() <= 4e-2 * np.abs(expected).max()
    assert not BaseGemm(256, skinny=True).runs_skinny(128) and not BaseGemm(256, skinny=True).runs_skinny(512)
    assert BaseGemm(256, skinny=True).runs_skinny(256) and not BaseGemm(256).runs_skinny(256)


def test_flag_default_and_validation():
    assert ServerArgs().gpu_gemm_min_tokens is None
    mesh = make_mesh(1)
    on_hopper = base_gemm_module.is_hopper(jax.devices()[0])
    default = make_base_gemm(None, mesh)
    assert (default.min_tokens if default else 0) == (DEFAULT_MIN_TOKENS if on_hopper else 0)
    assert make_base_gemm(0, mesh) is None
    assert make_base_gemm(256, mesh) == BaseGemm(256, mesh, reference=not on_hopper)  # CPU: the pure-JAX reference
    assert BaseGemm(256).runs(256) and BaseGemm(256).runs(2048) and not BaseGemm(256).runs(128)
    for bad in (-1, 1.5, True, "512"):
        with pytest.raises(ValueError, match="--gpu-gemm-min-tokens must be 0 \\(off\\) or a positive token count"):
            ServerArgs(gpu_gemm_min_tokens=bad)
    assert ServerArgs(gpu_gemm_min_tokens=0).gpu_gemm_min_tokens == 0


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two (fake) devices")
def test_the_default_is_on_for_one_hopper_gpu_only(monkeypatch):
    """On Hopper GPUs (stood in for by the platform check) the default runs the kernel itself on one device, and not
    under tensor parallelism, where the kernel has not run on GPUs yet; a value given there turns it on."""
    monkeypatch.setattr(base_gemm_module, "is_hopper", lambda device: True)
    one, two = make_mesh(1), make_mesh(2)
    default = make_base_gemm(None, one)
    assert default.mesh is one and not default.reference
    assert make_base_gemm(None, None).mesh is None
    assert make_base_gemm(None, two) is None
    assert make_base_gemm(1024, two) == BaseGemm(1024, two, reference=False)
    assert default.min_tokens == DEFAULT_MIN_TOKENS and default.runs(512) and not default.runs(128)
    assert default.keeps_xla_dots(256) and not default.runs(256)  # the 256 bucket keeps XLA's dots
    assert default.skinny and not make_base_gemm(1024, one).skinny  # the skinny form in the default's 256 bucket
    assert default.xla_dots and not make_base_gemm(1024, one).xla_dots


# ---- the engine, with LoRA ----------------------------------------------------------------------------------


def serve(model_dir, adapters, gpu_min_tokens: int, fused_min_tokens: int = 0, tp_size: int = 1) -> list[np.ndarray]:
    """The three PROMPTS (two adapters, one base) prefilled in one 256-token bf16 step, then two greedy decode steps
    in the 128-token bucket: each request's prompt and output logprobs."""
    flags = dict(gpu_gemm_min_tokens=gpu_min_tokens, lora_fused_gemm_min_tokens=fused_min_tokens, tp_size=tp_size)
    prompt, output = serve_logprobs(model_dir, adapters, 3, **flags)
    return [np.concatenate([p, o]) for p, o in zip(prompt, output)]


@pytest.fixture(scope="module")
def adapters(kernel_sized_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("basegemm_adapters")
    return [
        write_peft_adapter(
            kernel_sized_model, root / f"a{i}", seed=30 + i, r=16, lora_alpha=32, target_modules="all-linear"
        )
        for i in range(2)
    ]


@pytest.mark.slow
def test_the_default_keeps_xla_dots_in_the_256_bucket(kernel_sized_model, adapters, monkeypatch):
    """The default setting of one Hopper GPU (stood in for by its flags on the kernel's pure-JAX reference): a forward
    without adapters keeps XLA's dots in the 256 bucket (no kernel call of either form) and runs the kernel from the
    512 bucket; a step with adapters in the 256 bucket keeps XLA's dots too, beside the LoRA kernels; with the bound
    of XLA's dots lowered, that step runs the skinny kernel (4 modules traced once in the layer scan)."""
    import sgl_jax_lora.models.weight_loader as weight_loader

    def default_setting(min_tokens, mesh):
        return BaseGemm(min_tokens, mesh, reference=True, skinny=True, xla_dots=True)

    monkeypatch.setattr(weight_loader, "make_base_gemm", default_setting)
    skinny = count_calls(monkeypatch, base_gemm_module, "gemm_skinny_gpu")
    tiled = count_calls(monkeypatch, base_gemm_module, "gemm_gpu")
    ids = np.random.default_rng(11).integers(2, 491, 300)
    model_logits(kernel_sized_model, ids[:200], jnp.bfloat16, bucket=256, base_gemm_min_tokens=THRESHOLD)
    assert not skinny and not tiled
    model_logits(kernel_sized_model, ids, jnp.bfloat16, bucket=512, base_gemm_min_tokens=THRESHOLD)
    assert not skinny and len(tiled) == 4
    tiled.clear()
    with_adapters = serve(
        kernel_sized_model, adapters, gpu_min_tokens=THRESHOLD
    )  # a prefill step: two adapters, a base
    assert not skinny and not tiled
    default = BaseGemm(256, skinny=True, xla_dots=True)
    assert not default.runs(256) and default.keeps_xla_dots(256) and default.runs(512)
    assert not default.keeps_xla_dots(128) and not default.keeps_xla_dots(512)  # below the kernel's buckets; above
    assert BaseGemm(256, skinny=True).runs(256) and not BaseGemm(256, skinny=True).keeps_xla_dots(256)
    monkeypatch.setattr(base_gemm_module, "XLA_DOTS_MAX_TOKENS", 128)
    on_the_kernel = serve(kernel_sized_model, adapters, gpu_min_tokens=THRESHOLD)
    assert len(skinny) == 4 and not tiled
    for xla, kernel in zip(with_adapters, on_the_kernel):  # the same logprobs within bf16 rounding
        assert len(kernel) == len(xla) and np.abs(np.array(kernel) - np.array(xla)).max() < 0.2


@pytest.mark.slow
def test_engine_with_lora_and_the_base_gemm_kernel(kernel_sized_model, adapters, monkeypatch):
    """--gpu-gemm-min-tokens 256 against 0, LoRA on every module through the SGMV kernels: the prefill step's base
    GEMMs run the kernel (4 modules traced once in the layer scan; the flag reached the model), the decode steps
    (128-token bucket) XLA's dot; prompt and output logprobs agree within bf16 rounding (0.11 at most on an H200). With the fused LoRA GEMM
    on as well, every LoRA module of the prefill step takes the fused kernel, which wins over the base kernel."""
    calls = count_calls(monkeypatch, base_gemm_module, "gemm_gpu")
    expected = serve(kernel_sized_model, adapters, gpu_min_tokens=0)
    assert not calls
    ours = serve(kernel_sized_model, adapters, gpu_min_tokens=THRESHOLD)
    assert len(calls) == 4
    for got, want in zip(ours, expected):
        assert len(got) == len(want) and np.abs(np.array(got) - np.array(want)).max() < 0.2
    calls.clear()
    fused_calls = count_calls(monkeypatch, pallas_gpu_module, "gemm_lora_gpu")
    both = serve(kernel_sized_model, adapters, gpu_min_tokens=THRESHOLD, fused_min_tokens=THRESHOLD)
    assert not calls and len(fused_calls) == 4
    for got, want in zip(both, expected):
        assert np.abs(np.array(got) - np.array(want)).max() < 0.2


@pytest.mark.slow
@pytest.mark.parametrize("tp_size,base_calls", [(1, 4), (2, 3)])
def test_engine_with_gate_up_delta_in_the_gated_epilogue(
    kernel_sized_model, adapters, monkeypatch, tp_size, base_calls
):
    """The Pallas GPU backend handing gate|up's delta to the base GEMM kernel's gated epilogue (the default on Hopper
    GPUs, off elsewhere; set both ways here): with it, the prefill step's gate|up is one base GEMM call with the delta
    (o and down without; q|k|v too at tp 1, whose shard does not fit the kernel at tp 2), each device its columns of
    the delta at tp 2, and the prompt and output logprobs agree with the SGMV path's product + delta then the
    activation within bf16 rounding."""
    if len(jax.devices()) < tp_size:
        pytest.skip(f"needs {tp_size} (fake) devices")
    calls = count_calls(monkeypatch, base_gemm_module, "gemm_gpu")
    real_init = pallas_gpu_module.PallasGPUBackend.__init__

    def serve_with(gated_delta: bool) -> list[np.ndarray]:
        monkeypatch.setattr(
            pallas_gpu_module.PallasGPUBackend,
            "__init__",
            lambda self, *args, **kwargs: real_init(self, *args, **{**kwargs, "gated_delta": gated_delta}),
        )
        calls.clear()
        return serve(kernel_sized_model, adapters, gpu_min_tokens=THRESHOLD, tp_size=tp_size)

    expected = serve_with(False)
    assert [call["delta"] is not None for call in calls] == [False] * base_calls
    ours = serve_with(True)
    assert sorted(call["delta"] is not None for call in calls) == [False] * (base_calls - 1) + [True]
    assert [call["gated"] for call in calls if call["delta"] is not None] == [True]
    for got, want in zip(ours, expected):
        assert len(got) == len(want) and np.abs(np.array(got) - np.array(want)).max() < 0.2


@pytest.mark.parametrize("with_delta", [False, True])
def test_the_skinny_gated_form_with_and_without_a_lora_delta(with_delta):
    """gate|up in the skinny form: silu(gate (+ delta_gate)) * (up (+ delta_up)) after the kernel's product, each
    sum rounded as the unfused layers round it, the padding rows zero. On CPU the kernel's pure-JAX reference stands
    in for the kernel."""
    rng = np.random.default_rng(3)
    num_tokens, num_rows, hidden, inter = 64, 37, 128, 256
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.bfloat16)
    stack = jnp.asarray(rng.standard_normal((2, hidden, 2 * inter)) / np.sqrt(hidden), jnp.bfloat16)
    delta = jnp.asarray(rng.standard_normal((num_tokens, 2 * inter)) * 0.1, jnp.bfloat16) if with_delta else None
    config = BaseGemm(64, reference=True, skinny=True)
    rows = jnp.array([num_rows], jnp.int32)
    kernel = LayerStack(stack, jnp.int32(1))
    ours = base_gemm_module.base_gemm(x, kernel, config, LINEAR_AXES["gate_up_proj"], rows, gated=True, delta=delta)
    y = jnp.dot(x.astype(jnp.float32), stack[1].astype(jnp.float32)).astype(jnp.bfloat16)
    y = y if delta is None else y + delta
    gate, up = jnp.split(y, 2, axis=-1)
    want = np.asarray(jax.nn.silu(gate) * up, np.float32)
    ours = np.asarray(ours, np.float32)
    assert ours.shape == (num_tokens, inter)
    np.testing.assert_array_equal(ours[:num_rows], want[:num_rows])
    assert not ours[num_rows:].any()
