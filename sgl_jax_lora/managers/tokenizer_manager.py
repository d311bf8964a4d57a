"""TokenizerManager: the asyncio frontend of one engine: validate, tokenize, send, detokenize, stream.

Flow:
  Engine.generate / HTTP handler -> managers/request_normalizer.py (prompts, per-prompt values, n, adapters)
    -> `build_request` here: validate + tokenize -> GenerateRequest
    -> `generate_request(request)` (async generator): EngineClient.send(GenerateRequest) over the pipe
    <- EngineOutput items, routed by the EngineClient's reader thread to the request's asyncio queue
    -> cumulative result dicts ({"text", "output_ids", "meta_info"}) yielded per increment (request_output.py:
       detokenization and stop strings, which finish the request here and abort it in the engine); increments that
       arrive while the consumer is busy (a slow client) go into one result, and a caller that needs only the last
       (`every_increment=False`) gets the first with a token and the last, not a result built per token.
The EngineClient (managers/engine_client.py) spawns the engine process and owns its pipe; this process never
imports JAX, so HTTP and tokenization never stall the device loop. Cancelling the generator (client disconnect)
aborts the request in the engine. Adapters: names resolved and loaded on demand by managers/lora_frontend.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.registry import LoRARegistry
from sgl_jax_lora.lora.tensor_file import TensorFile
from sgl_jax_lora.managers.engine_client import EngineClient, EngineDeadError, RequestError, ServerBusyError
from sgl_jax_lora.managers.io_struct import (
    EngineCall,
    EngineOutput,
    GenerateRequest,
)
from sgl_jax_lora.managers.lora_frontend import LoRAFrontend
from sgl_jax_lora.managers.prompt_limits import check_context_length, max_prompt_chars
from sgl_jax_lora.managers.request_ids import RequestIds
from sgl_jax_lora.managers.request_output import RequestOutput
from sgl_jax_lora.managers.request_priority import check_priority
from sgl_jax_lora.managers.stop_checker import tokenizer_eos_ids
from sgl_jax_lora.managers.token_pieces import TokenPieces
from sgl_jax_lora.managers.tokenizer_files import load_tokenizer
from sgl_jax_lora.sampling.sampling_params import (
    MAX_TOP_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    checked_int,
    model_sampling_defaults,
)
from sgl_jax_lora.server_args import ServerArgs

logger = logging.getLogger(__name__)
T = TypeVar("T")


__all__ = ["EngineDeadError", "RequestError", "ServerBusyError", "TokenizerManager"]


@contextlib.contextmanager
def adapter_errors_refuse_the_request() -> Iterator[None]:
    """An adapter's problem (LoRAAdapterError) refuses the request that met it: RequestError, the cause kept."""
    try:
        yield
    except LoRAAdapterError as e:
        raise RequestError(str(e)) from e


class TokenizerManager:
    def __init__(self, args: ServerArgs, model_path: str):
        self.args = args
        self.model_path = model_path
        ModelConfig.from_model_path(model_path)  # its errors before the tokenizer's loader reads config.json its way
        flag = "--tokenizer-path" if args.tokenizer_path else "--model-path"
        self.tokenizer = load_tokenizer(args.tokenizer_path or model_path, flag)
        self.token_pieces = TokenPieces(self.tokenizer)  # logprobs' token texts and bytes, decoded once per id
        # under each request's own sampling params; read (and checked) before the engine starts compiling
        self.sampling_defaults = model_sampling_defaults(model_path) if args.sampling_defaults == "model" else {}
        # spawns the engine; returns once it has compiled
        self.client = EngineClient(args, model_path, tokenizer_eos_ids(self.tokenizer))
        self.server_info = self.client.server_info
        self.context_length = self.server_info["context_length"]
        self.max_total_tokens = self.server_info["max_total_tokens"]
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.context_length)  # longer texts cannot fit
        # per-request CPU work (JSON, tokenization, chat templates, adapter file checks) runs here, off the loop
        self.cpu_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="frontend-cpu")
        self.lora_frontend = LoRAFrontend(args, model_path, self.call, self.cpu_pool)
        for ref in self.server_info.get("loras", []):
            self.lora_registry.register(LoRARef(**ref), alias_ok=True)  # --lora-paths: the operator's names
        self.request_ids = RequestIds()  # clients' names of their running requests (rid)

    @property
    def process(self):
        """The engine process (multiprocessing.Process)."""
        return self.client.process

    @property
    def is_dead(self) -> bool:
        return self.client.is_dead

    @is_dead.setter
    def is_dead(self, value: bool) -> None:
        self.client.is_dead = value

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin routing engine messages into `loop` (call once, from or for the serving loop)."""
        self.client.start(loop)

    async def call(self, call: EngineCall) -> object:
        """A synchronous request to the engine process (ServerInfoCall, the LoRA calls) -> its result."""
        return await self.client.call(call)

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        if input_ids is None:
            if not isinstance(text, str):
                raise RequestError(
                    f"a prompt must be a string (or given as token ids), got {type(text).__name__}; check the prompts"
                )
            self.check_prompt_chars(text)
            input_ids = self.tokenizer.encode(text)
        if not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            raise RequestError("input_ids must be a list of integers")
        if not input_ids:
            raise RequestError("the prompt is empty; send at least one token")
        vocab = self.server_info["vocab_size"]
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"input_ids contain ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return input_ids

    def check_prompt_chars(self, text: str) -> None:
        """RequestError for a text longer than any tokenization that fits the context (refused before it is
        tokenized: a 50 MB text would hold a worker for minutes only to be refused after)."""
        if len(text) > self.max_prompt_chars:
            raise RequestError(
                f"text has {len(text)} characters, more than the {self.max_prompt_chars} that could "
                f"fit the context length {self.context_length}; shorten the prompt"
            )

    async def run_cpu(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """`fn(*args, **kwargs)` on the frontend's CPU pool: the event loop keeps answering meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, functools.partial(fn, *args, **kwargs))

    def _check_stops(self, sampling: SamplingParams) -> None:
        """--max-stop-strings and --max-stop-string-chars (a stop string is searched in every new token's text)."""
        limit, chars = self.args.max_stop_strings, self.args.max_stop_string_chars
        for field, values in (("stop", sampling.stop), ("stop_token_ids", sampling.stop_token_ids)):
            if len(values) > limit:
                raise RequestError(
                    f"{field} has {len(values)} entries, more than --max-stop-strings {limit}; send fewer"
                )
        longest = max((len(s) for s in sampling.stop), default=0)
        if longest > chars:
            raise RequestError(
                f"stop holds a string of {longest} characters, more than --max-stop-string-chars {chars}"
            )
        vocab = self.server_info["vocab_size"]
        outside = [t for t in sampling.stop_token_ids if t >= vocab]
        if outside:
            raise RequestError(f"stop_token_ids names token ids outside the vocabulary [0, {vocab}): {outside[:5]}")

    def build_request(
        self,
        text: str | None = None,
        input_ids: list[int] | None = None,
        sampling_params: dict | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        lora_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> GenerateRequest:
        """Validate and tokenize one request (raises RequestError naming the problem). `arrival_time`: when the
        client's request came in (time.monotonic(), taken before its adapter was resolved); default now."""
        try:
            sampling = SamplingParams.from_dict({**self.sampling_defaults, **(sampling_params or {})})
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from e
        self._check_stops(sampling)
        ids = self.tokenize(text, input_ids)
        vocab = self.server_info["vocab_size"]
        outside = [t for t in sampling.logit_bias if t >= vocab]
        if outside:
            raise RequestError(f"logit_bias names token ids outside the vocabulary [0, {vocab}): {outside[:5]}")
        try:
            # a prompt-only request (max_new_tokens 0) still samples the token after its prompt
            check_context_length(len(ids), max(sampling.max_new_tokens, 1), self.context_length)
        except ValueError as e:
            raise RequestError(str(e)) from None
        try:
            top_logprobs_num = checked_int("top_logprobs_num", top_logprobs_num, 0, MAX_TOP_LOGPROBS)
            logprob_start_len = checked_int("logprob_start_len", logprob_start_len, -1, self.context_length - 1)
        except SamplingParamsError as e:
            raise RequestError(str(e)) from None
        priority = check_priority(priority, self.args.scheduling_policy)
        return GenerateRequest(
            rid=uuid.uuid4().hex,
            input_ids=ids,
            sampling=sampling,
            return_logprob=bool(return_logprob),
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            lora_id=lora_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
        )

    # ---- LoRA adapters (managers/lora_frontend.py) ---------------------------------------------
    @property
    def lora_registry(self) -> LoRARegistry:
        return self.lora_frontend.registry

    def list_loras(self) -> list[LoRARef]:
        return self.lora_registry.list_refs()

    async def resolve_lora(self, lora_path: str | None) -> LoRARef | None:
        """Adapter name (or path, however spelled) -> its LoRARef, counted in flight until the request ends.
        An unregistered path is loaded on demand only if it lies inside --lora-allowed-dirs."""
        with adapter_errors_refuse_the_request():
            return await self.lora_frontend.resolve(lora_path)

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, pinned: bool = False, trusted: bool = False
    ) -> dict:
        """Register and load an adapter. Untrusted (HTTP) calls may only read inside --lora-allowed-dirs."""
        with adapter_errors_refuse_the_request():
            return await self.lora_frontend.load(lora_name, lora_path, pinned=pinned, trusted=trusted)

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        """Unregister at once, wait for the adapter's in-flight requests, then free host and device copies."""
        with adapter_errors_refuse_the_request():
            return await self.lora_frontend.unload(lora_name)

    async def load_lora_adapter_from_tensors(
        self, lora_name: str, tensors: TensorFile, config: dict, pinned: bool = False
    ) -> dict:
        """Register an adapter from memory: `tensors` a safetensors-layout file in shared memory (PEFT names, the
        caller removes it once this returns), `config` the fields of its adapter_config.json. The engine runs the
        checks of a load from disk."""
        with adapter_errors_refuse_the_request():
            return await self.lora_frontend.load_from_tensors(lora_name, tensors, config, pinned)

    async def update_lora_adapter(self, lora_name: str, tensors: TensorFile, config: dict | None = None) -> dict:
        """Serve new weights under `lora_name` as its next version (LoRAFrontend.update): running requests finish on
        the version they started with, which is unloaded once they are done."""
        with adapter_errors_refuse_the_request():
            return await self.lora_frontend.update(lora_name, tensors, config)

    async def wait_for_retired_versions(self) -> None:
        """Return once every replaced adapter version has finished its requests and been unloaded."""
        await self.lora_frontend.wait_for_retired_versions()

    async def generate_request(self, request: GenerateRequest, every_increment: bool = True) -> AsyncIterator[dict]:
        """Send one request; yield its cumulative result after every increment, the last one finished. The increments
        that arrived while the caller was away (a slow stream reader) make one result: a result is cumulative, and one
        built per increment for a reader that cannot keep up would cost time and memory growing with the square of the
        output (its logprobs). every_increment=False (a caller that keeps the last): the first result that holds a
        token, then the last. A stop string finishes the request here (managers/request_output.py); the engine, which
        may have decoded past it, is told to abort. Raises ServerBusyError, before anything is sent, when the server
        holds all the requests it may."""
        sampling = request.sampling
        output = RequestOutput(
            self.tokenizer, sampling.skip_special_tokens, sampling.stop, request.input_ids, request.prompt_only
        )
        queue = None
        first_token_sent = False
        try:
            self._check_capacity()  # no await between the count and the stream that joins it
            self.request_ids.hold(request, self.client.has_stream)
            queue = self.client.open_stream(request.rid)
            self.client.send(request.for_engine())
            while not output.finished:
                item = await queue.get()
                while True:
                    if isinstance(item, Exception):
                        raise item
                    output.add(item)
                    if output.finished or queue.empty():
                        break
                    item = queue.get_nowait()
                if every_increment or output.finished or (output.output_ids and not first_token_sent):
                    first_token_sent = first_token_sent or bool(output.output_ids)
                    yield self._result(request, output, item)
        finally:
            if queue is not None:
                self.request_ids.release(request)
                self.client.close_stream(request.rid)
                if not output.engine_finished and not self.is_dead:  # stopped here, or the client went away
                    self.client.abort(request.rid)
            if request.lora_id is not None:
                self.lora_registry.release(request.lora_id)

    @property
    def num_requests_held(self) -> int:
        """Requests sent to the engine and not yet finished there (what --max-queued-requests bounds): streams whose
        client stopped reading after the engine finished them do not keep other clients out."""
        return self.client.num_unfinished

    @property
    def max_requests_held(self) -> int | None:
        """--max-running-requests + --max-queued-requests, or None without a queue limit."""
        queued = self.args.max_queued_requests
        return None if queued is None else self.args.max_running_requests + queued

    def _check_capacity(self) -> None:
        """--max-queued-requests: the server holds at most that many requests beyond --max-running-requests."""
        limit = self.max_requests_held
        if limit is not None and self.num_requests_held >= limit:
            raise ServerBusyError(
                f"the server is busy: it holds {limit} requests, its limit (--max-running-requests "
                f"{self.args.max_running_requests} running + --max-queued-requests {self.args.max_queued_requests} "
                "waiting); retry when some have finished, or ask the operator to raise --max-queued-requests"
            )

    def _result(self, request: GenerateRequest, output: RequestOutput, item: EngineOutput) -> dict:
        result = output.result(request, item)
        ref = self.lora_registry.ref_of(request.lora_id) if request.lora_id is not None else None
        if ref is not None:  # the adapter version that served the whole request
            result["meta_info"]["lora_name"], result["meta_info"]["lora_version"] = ref.lora_name, ref.version
        return result

    def abort(self, rid: str) -> None:
        self.client.abort(rid)

    def shutdown(self) -> None:
        self.client.shutdown()
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)
