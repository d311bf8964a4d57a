"""Engine: the offline API (no HTTP), shaped like SGLang's offline engine.

Flow: Engine(**server_args) spawns the engine process through a TokenizerManager (its EngineClient) and runs
its asyncio loop on a background thread; `generate(...)` goes through the request front door
(managers/request_normalizer.py: prompts, per-prompt values, n, adapters), which validates every prompt first
(so a bad one refuses the call before anything runs), then submits them all at once and returns the finished
result dicts.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import os
import threading

from sgl_jax_lora.demo_model import with_demo_defaults
from sgl_jax_lora.lora.tensor_file import TensorFile
from sgl_jax_lora.managers.io_struct import FlushCacheCall, ServerInfoCall, StartProfileCall, StopProfileCall
from sgl_jax_lora.managers.request_normalizer import ENGINE, PromptRefused, build_requests, normalize
from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager
from sgl_jax_lora.server_args import ServerArgs
from sgl_jax_lora.utils.gather import gather_or_cancel


class Engine:
    def __init__(self, config: str | None = None, **kwargs: object):
        """Engine(model_path=..., tp_size=..., ...): the ServerArgs fields as keywords. `config` names a JSON or
        YAML file of the same fields (as `launch --config`); keywords given here override it."""
        self.server_args = ServerArgs.from_kwargs(config=config, **kwargs)
        if self.server_args.node_rank > 0:
            raise ValueError(
                f"node_rank={self.server_args.node_rank}: an Engine runs on node 0 only; start node "
                f"{self.server_args.node_rank} with `python -m sgl_jax_lora.launch --nnodes {self.server_args.nnodes} "
                f"--node-rank {self.server_args.node_rank} --dist-init-addr {self.server_args.dist_init_addr} ...`"
            )
        self.server_args, model_path = with_demo_defaults(self.server_args)  # no model path: the demo and its adapters
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-frontend", daemon=True)
        self._thread.start()
        self.tokenizer_manager = TokenizerManager(self.server_args, model_path)
        self.tokenizer_manager.start(self._loop)
        # an Engine not shut down is shut down at exit, before multiprocessing terminates its process (atexit runs
        # the last registered first)
        atexit.register(self.shutdown)

    def _run(self, coroutine):
        """Run `coroutine` on the engine's loop and wait for it; an interrupt (Ctrl-C) cancels it there, which
        aborts the requests it sent."""
        if self._closed:
            coroutine.close()
            raise RuntimeError("this Engine was shut down; create a new Engine to generate again")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self._closed:  # shutdown() cancelled it
                raise RuntimeError("this Engine was shut down while the call ran; its requests were aborted") from None
            raise
        except BaseException:
            future.cancel()
            raise

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        lora_path: str | list[str | None] | None = None,
        priority: int = 0,
    ) -> dict | list[dict]:
        """One prompt -> one result dict; a list of prompts -> a list of result dicts, in order.

        `n` in the sampling params (the same for every prompt) samples each prompt n times: a list of
        results, prompt-major (sampling/parallel_sampling.py). `priority`: lower is admitted first, with
        `scheduling_policy="priority"`."""
        batch = normalize(
            *map(_plain, (prompt, input_ids, sampling_params, lora_path)),
            _flag("return_logprob", return_logprob),
            *map(_plain, (logprob_start_len, top_logprobs_num)),
            dialect=ENGINE,
            priority=_plain(priority),
        )
        try:
            requests = self._run(build_requests(self.tokenizer_manager, batch))
        except PromptRefused as e:  # the offline caller gets the error itself (ValueError, EngineDeadError, ...)
            if e.where:
                e.cause.args = (e.where + str(e.cause),)  # which prompt of the batch
            raise e.cause from None
        results = self._run(self._generate_all(requests))
        return results if batch.answers_list else results[0]

    async def _generate_all(self, requests) -> list[dict]:
        """Every request's last result; the first refused (past --max-queued-requests, say) aborts the others."""

        async def one(request):
            result = None
            async for result in self.tokenizer_manager.generate_request(request, every_increment=False):  # noqa: B007
                pass
            return result

        return await gather_or_cancel([one(r) for r in requests])

    def load_lora_adapter(self, lora_name: str, lora_path: str | os.PathLike, pinned: bool = False) -> dict:
        """Register an adapter while the engine runs (the offline caller is the operator: any path)."""
        path = os.fspath(lora_path) if isinstance(lora_path, os.PathLike) else lora_path
        return self._run(
            self.tokenizer_manager.load_lora_adapter(lora_name, path, _flag("pinned", pinned), trusted=True)
        )

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: dict, config: dict, pinned: bool = False) -> dict:
        """Register an adapter held in memory: `tensors` maps PEFT tensor names ("...q_proj.lora_A.weight") to numpy,
        JAX or torch arrays, `config` holds adapter_config.json's fields (r, lora_alpha, target_modules, ...). Same checks
        and device path as a load from disk; nothing is compiled."""
        pinned = _flag("pinned", pinned)
        with TensorFile.from_arrays(lora_name, tensors) as tensor_file:
            return self._run(
                self.tokenizer_manager.load_lora_adapter_from_tensors(
                    lora_name, tensor_file, _plain_config(config), pinned
                )
            )

    def update_lora_adapter(self, lora_name: str, tensors: dict, config: dict | None = None) -> dict:
        """New weights for a loaded adapter (its config kept unless `config` is given): requests sent from now on
        use them; running ones finish on the version they started with. Returns the new version number."""
        plain = _plain_config(config) if config is not None else None
        with TensorFile.from_arrays(lora_name, tensors) as tensor_file:
            return self._run(self.tokenizer_manager.update_lora_adapter(lora_name, tensor_file, plain))

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Unregister; waits for the adapter's in-flight requests, then frees its host and device copies."""
        return self._run(self.tokenizer_manager.unload_lora_adapter(lora_name))

    def flush_cache(self) -> dict:
        """Free the prefix cache's pages that no request holds (a benchmark's next run starts cold) ->
        {"kv_pages_freed": N}; pages that running requests hold stay."""
        return dataclasses.asdict(self._run(self.tokenizer_manager.call(FlushCacheCall())))

    def start_profile(self, num_steps: int | None = None) -> dict:
        """Trace the engine's next `num_steps` steps (None: until `stop_profile`) with jax.profiler, into a new
        directory under --profile-dir -> {"trace_dir", "num_steps"}; ValueError naming the fix when the engine was
        started without profile_dir, or a trace is running."""
        return dataclasses.asdict(self._run(self.tokenizer_manager.call(StartProfileCall(_plain(num_steps)))))

    def stop_profile(self) -> dict:
        """End the running trace and write its files -> {"trace_dir", "num_steps"} (the steps it holds)."""
        return dataclasses.asdict(self._run(self.tokenizer_manager.call(StopProfileCall())))

    def get_server_info(self) -> dict:
        info = self._run(self.tokenizer_manager.call(ServerInfoCall()))
        return {"server_args": self.server_args.info_dict(), **info}

    def shutdown(self) -> None:
        """Stop the engine process and the engine's loop; calls after it raise RuntimeError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._thread.is_alive():  # calls still running (on other threads) end with RuntimeError, not for ever
            cancelled = asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self._loop)
            with contextlib.suppress(concurrent.futures.TimeoutError):
                cancelled.result(timeout=SHUTDOWN_CANCEL_S)
        self.tokenizer_manager.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


SHUTDOWN_CANCEL_S = 10.0  # how long shutdown() waits for the calls still running to end


async def _cancel_other_tasks() -> None:
    """Cancel every task on the running loop but this one (each call's, which aborts its requests) and wait for them."""
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def _plain(value: object) -> object:
    """numpy and JAX arrays and scalars (prompt token ids, sampling values) as the Python lists and numbers the
    request front door takes; lists, tuples and dicts converted inside; anything else as given (checked there)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if not isinstance(value, (str, bytes)) and type(value).__module__.split(".")[0] in ("numpy", "jax", "jaxlib"):
        return value.tolist()
    return value


def _flag(name: str, value: object) -> bool:
    """A True/False argument (numpy's bool too) as a bool; ValueError for anything else ("no" is not False)."""
    plain = _plain(value)
    if not isinstance(plain, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return plain


def _plain_config(config: dict) -> dict:
    """adapter_config fields as plain data for the engine's pipe (PEFT's to_dict holds sets)."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict of adapter_config.json fields, got {type(config).__name__}")
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.items()}
