"""The request front door: what a caller asked for -> validated engine requests, one per prompt and sample.

Flow: the offline `Engine.generate`, POST /generate (entrypoints/native_api.py) and the OpenAI routes
(entrypoints/openai_api.py, which first map their fields onto these) all come through here:
  `normalize(text | input_ids, sampling_params, lora_path, logprob options)` -- one prompt or a batch, values
      given once or per prompt -- or, for callers that already hold their prompts, `with_samples(specs, n)`
    -> RequestBatch: one PromptSpec per engine request, `n` samples per prompt laid out prompt-major
       (sampling/parallel_sampling.py), and whether the answer is a list
  `build_requests(tm, batch)`: each spec's adapter resolved (LoRAFrontend), then validated and tokenized
      (TokenizerManager.build_request, on the frontend's CPU pool) -> GenerateRequest
Every request is built before any is sent, so one bad prompt refuses the whole call. Shape errors raise
RequestError worded for the caller's Dialect (ENGINE: prompt= / input_ids= keywords; HTTP: 'text' / 'input_ids');
a prompt that cannot be built raises PromptRefused, which names the prompt of a batch and keeps the cause (the
HTTP layer maps it in entrypoints/errors.py; the Engine raises the cause itself). Adapters already acquired for a
refused call are released here.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from sgl_jax_lora.managers.engine_client import RequestError
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.managers.request_ids import check_client_rid
from sgl_jax_lora.sampling.parallel_sampling import check_num_samples, expand_samples, samples_per_prompt
from sgl_jax_lora.sampling.sampling_params import SamplingParamsError

if TYPE_CHECKING:
    from sgl_jax_lora.lora.lora_ref import LoRARef
    from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager


@dataclasses.dataclass(frozen=True)
class Dialect:
    """How one API spells its requests: its shape errors, in the names its callers use, and whether an empty
    lora_path means the base model (the offline Engine) or an adapter name to resolve (HTTP: refused)."""

    neither_or_both: str
    bad_prompt_list: str
    count_mismatch: str  # .format(name=, given=, count=)
    wrong_type: str  # .format(name=, type=, got=)
    empty_lora_is_base: bool = False


ENGINE = Dialect(
    neither_or_both="pass exactly one of prompt= (str or list of str) or input_ids= (list of ints or list of lists)",
    bad_prompt_list="prompt must be a string or a non-empty list of strings",
    count_mismatch="{name} has {given} entries but there are {count} prompts; give one per prompt or a single value",
    wrong_type="{name} must be a {type} or a list of them, got {got}",
    empty_lora_is_base=True,
)
HTTP = Dialect(
    neither_or_both=(
        "give exactly one of 'text' (a string or a list of strings) or 'input_ids' (a list of ints or a list of lists)"
    ),
    bad_prompt_list="'text' is an empty list; send at least one prompt",
    count_mismatch="'{name}' has {given} entries but there are {count} prompts; give one per prompt or a single value",
    wrong_type="'{name}' must be a {type} or a list of them, got {got}",
)


@dataclasses.dataclass
class PromptSpec:
    """One engine request to build: a prompt (text or token ids) and its options, before tokenization."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict | None = None
    lora_path: str | None = None  # an adapter name or path; None: the base model
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    priority: int = 0  # lower is admitted first under --scheduling-policy priority
    rid: str | None = None  # the client's name for the request (its meta_info.id, POST /abort_request)


@dataclasses.dataclass
class RequestBatch:
    """The engine requests of one call: `copies_per_prompt` specs per prompt, prompt-major."""

    specs: list[PromptSpec]
    num_prompts: int
    copies_per_prompt: int = 1
    is_batch: bool = False  # the prompts came as a list: errors name the prompt

    @property
    def answers_list(self) -> bool:
        """A batch, or one prompt with n > 1 samples, answers with a list of results."""
        return self.is_batch or self.copies_per_prompt > 1


class PromptRefused(RequestError):
    """A prompt of the call could not be built: `cause` is the error, `where` names the prompt in a batch
    ("prompt 1: ") and `stage` is "lora" (its adapter could not be resolved) or "request" (validation)."""

    def __init__(self, cause: Exception, where: str, stage: str):
        super().__init__(where + str(cause))
        self.cause, self.where, self.stage = cause, where, stage


def normalize(
    text: str | list[str] | None = None,
    input_ids: list[int] | list[list[int]] | None = None,
    sampling_params: dict | list[dict] | None = None,
    lora_path: str | list[str | None] | None = None,
    return_logprob: bool = False,
    logprob_start_len: int = -1,
    top_logprobs_num: int = 0,
    dialect: Dialect = HTTP,
    priority: int = 0,
    rid: str | list[str] | None = None,
) -> RequestBatch:
    """One prompt or a batch, with values given once or per prompt -> its RequestBatch (`n` in the sampling
    params, the same for every prompt, gives n samples per prompt; a `rid` names one request: one per prompt,
    none with n > 1). Raises RequestError."""
    texts, ids, is_batch = split_prompts(text, input_ids, dialect)
    count = len(texts)
    params = per_prompt("sampling_params", sampling_params, count, dict, dialect)
    loras = per_prompt("lora_path", lora_path, count, str, dialect)
    if dialect.empty_lora_is_base:
        loras = [lora or None for lora in loras]
    try:
        n = samples_per_prompt(params)
    except SamplingParamsError as e:
        raise RequestError(str(e)) from e
    rids = client_rids(rid, count, n, dialect)
    specs = [
        PromptSpec(
            texts[i],
            ids[i],
            sample_params,
            loras[i],
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            priority,
            rids[i],
        )
        for i in range(count)
        for sample_params in expand_samples(params[i], n)
    ]
    return RequestBatch(specs, count, n, is_batch)


def client_rids(rid: object, count: int, n: int, dialect: Dialect) -> list[str | None]:
    """One client rid per prompt (or None each): each names one request, so none with n > 1, and no two alike."""
    if rid is None:
        return [None] * count
    if count > 1 and not isinstance(rid, list):
        raise RequestError("rid names one request: give a list of them, one per prompt of the batch")
    rids = per_prompt("rid", rid, count, str, dialect)
    for value in rids:
        check_client_rid(value)
    if n > 1:
        raise RequestError("rid names one request, and n > 1 makes several; leave it out (each meta_info.id names one)")
    if len(set(rids)) < len(rids):
        raise RequestError("rid has the same name twice; give each prompt its own")
    return rids


def with_samples(prompts: list[PromptSpec], n: object, is_batch: bool) -> RequestBatch:
    """n samples of each prompt (prompt-major; with a seed, sample j gets seed + j). Raises RequestError."""
    try:
        n = check_num_samples(n)
    except SamplingParamsError as e:
        raise RequestError(str(e)) from e
    specs = [
        dataclasses.replace(prompt, sampling_params=params)
        for prompt in prompts
        for params in expand_samples(prompt.sampling_params, n)
    ]
    return RequestBatch(specs, len(prompts), n, is_batch)


def split_prompts(text: object, input_ids: object, dialect: Dialect) -> tuple[list, list, bool]:
    """-> (texts, token id lists, is_batch), one entry per prompt (None where the other form was given)."""
    if (text is None) == (input_ids is None):
        raise RequestError(dialect.neither_or_both)
    if text is not None:
        if isinstance(text, str):
            return [text], [None], False
        if not isinstance(text, list) or not text:
            raise RequestError(dialect.bad_prompt_list)
        return list(text), [None] * len(text), True
    if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
        return [None] * len(input_ids), list(input_ids), True
    return [None], [input_ids], False  # one prompt (its ids are checked when the request is built)


def prompt_count(text: object, input_ids: object) -> int:
    """The prompts a call holds, as `split_prompts` counts them, without building anything per prompt: the per-call
    limit is checked on it before a call of millions of prompts costs the event loop anything."""
    if isinstance(text, list):
        return len(text)
    if text is None and isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
        return len(input_ids)
    return 1


def per_prompt(name: str, value: object, count: int, item_type: type, dialect: Dialect) -> list:
    """A value given once, or one per prompt -> one per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(dialect.count_mismatch.format(name=name, given=len(value), count=count))
        return value
    if value is not None and not isinstance(value, item_type):
        raise RequestError(dialect.wrong_type.format(name=name, type=item_type.__name__, got=type(value).__name__))
    return [value] * count


async def build_requests(tm: TokenizerManager, batch: RequestBatch) -> list[GenerateRequest]:
    """One validated GenerateRequest per spec, adapters resolved (each counted in flight until its request ends).

    Raises PromptRefused for the first spec that cannot be built, naming its prompt (in a batch) as the client
    numbered it: spec i belongs to prompt i // copies_per_prompt. The adapters acquired for the call are released."""
    received = time.monotonic()  # before any adapter load: the requests keep their place in the engine's queue
    refs: list[LoRARef] = []
    requests = []
    try:
        for i, spec in enumerate(batch.specs):
            where = f"prompt {i // batch.copies_per_prompt}: " if batch.is_batch else ""
            if spec.rid is not None:  # a name in use refuses the call before any of it runs
                try:
                    tm.request_ids.check_free(spec.rid, tm.client.has_stream)
                except RequestError as e:
                    raise PromptRefused(e, where, "request") from e
            try:
                ref = await tm.resolve_lora(spec.lora_path) if spec.lora_path is not None else None
            except Exception as e:
                raise PromptRefused(e, where, "lora") from e
            if ref is not None:
                refs.append(ref)
            try:
                requests.append(await tm.run_cpu(_build_one, tm, spec, ref, received))
            except Exception as e:
                raise PromptRefused(e, where, "request") from e
    except BaseException:
        for ref in refs:
            tm.lora_registry.release(ref.lora_id)
        raise
    return requests


def _build_one(tm: TokenizerManager, spec: PromptSpec, ref: LoRARef | None, received: float) -> GenerateRequest:
    request = tm.build_request(
        text=spec.text,
        input_ids=spec.input_ids,
        sampling_params=spec.sampling_params,
        return_logprob=spec.return_logprob,
        logprob_start_len=spec.logprob_start_len,
        top_logprobs_num=spec.top_logprobs_num,
        priority=spec.priority,
        lora_id=ref.lora_id if ref is not None else None,
        arrival_time=received,
    )
    return dataclasses.replace(request, client_rid=spec.rid) if spec.rid is not None else request
