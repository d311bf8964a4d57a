"""EngineCore: the device loop of one engine process: admit requests, schedule, run, postprocess.

Flow of one step (`step()`), overlap schedule (the default):
    batch = scheduler.schedule()                          # decode rows + prefill chunks, one ragged step, planned
                                                          # while the previous step still runs on the device
    forward_batch = batch.to_forward_batch(...)           # padded to a compiled bucket
    launched = _launch(...)                               # forward + sampling dispatched, not waited for; tokens
                                                          # of the previous step are read on the device
    outputs = _finish(previous step)                      # its tokens reach the host: token-level stop checks
                                                          # (stop strings are the frontend's), free pages
    _advance(launched)                                    # the new step's tokens become pending (req.py)
so the host's work for step N+1 overlaps the device's work for step N. With --disable-overlap-schedule a step
finishes itself before `step()` returns. Penalties keep the overlap: a request's token still in flight is counted
on the device (sampling/logit_adjustments.py).
Requests arrive as plain dicts (managers/io_struct.py) and leave as incremental output dicts.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from sgl_jax_lora.distributed.leader_runner import make_model_runner
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.lora_setup import LoRASetup
from sgl_jax_lora.managers.io_struct import EngineOutput, GenerateRequest
from sgl_jax_lora.managers.prompt_limits import check_context_length
from sgl_jax_lora.managers.req import PENDING_TOKEN, Req
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch
from sgl_jax_lora.managers.scheduler import Scheduler
from sgl_jax_lora.managers.step_stats import StepStats
from sgl_jax_lora.managers.stop_checker import StopChecker, eos_token_ids
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator
from sgl_jax_lora.mem_cache.prefix_cache import PrefixCache
from sgl_jax_lora.model_executor.buckets import Buckets
from sgl_jax_lora.model_executor.compile_counter import CompileCounter
from sgl_jax_lora.model_executor.forward_batch import ForwardBatch
from sgl_jax_lora.model_executor.model_runner import LaunchedSample
from sgl_jax_lora.models.model_config import ModelConfig
from sgl_jax_lora.sampling.logit_adjustments import LogitAdjustments, LogitRow, pack_logit_rows
from sgl_jax_lora.sampling.sampling_params import MAX_LOGIT_BIAS_IDS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS
from sgl_jax_lora.server_args import ServerArgs
from sgl_jax_lora.utils.progress import startup_progress

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step on the device whose sampled tokens have not been read yet."""

    batch: ScheduleBatch
    sampled: LaunchedSample | None  # None: no request samples (prefill chunks only)


class EngineCore:
    def __init__(self, args: ServerArgs, model_path: str):
        self.compile_counter = CompileCounter()
        self.args = args
        self.cfg = ModelConfig.from_model_path(model_path)
        self.cfg.check_tensor_parallel(args.tp_size)
        self.context_length = min(
            args.context_length or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings
        )
        self.mesh = make_mesh(args.tp_size)
        self.lora_setup = LoRASetup(args, model_path, self.mesh) if args.enable_lora else None
        self.stop_checker = StopChecker(eos_token_ids(args.tokenizer_path or model_path, self.cfg.eos_token_ids))
        # a request's logit-adjustment entries: distinct prompt and output ids, logit_bias ids, banned ids
        max_logit_entries = (
            min(self.cfg.vocab_size, self.context_length + MAX_LOGIT_BIAS_IDS)
            + MAX_STOP_TOKEN_IDS
            + len(self.stop_checker.eos_token_ids)
        )
        self.buckets = Buckets.build(
            args.max_running_requests,
            args.chunked_prefill_size,
            self.context_length,
            args.page_size,
            args.token_buckets,
            max_logit_entries_per_row=max_logit_entries,
        )
        self.runner = make_model_runner(args, self.cfg, self.mesh, self.buckets, self.lora_setup)  # multi-host: leader
        self.lora = self.lora_setup.build_manager(self.runner) if self.lora_setup else None
        self.allocator = PageAllocator(self.runner.num_pages, args.page_size)
        self.max_total_tokens = self.allocator.num_usable * args.page_size
        self.prefix_cache = None if args.disable_prefix_cache else PrefixCache(self.allocator)
        self.scheduler = Scheduler(
            self.buckets,
            self.allocator,
            args.max_running_requests,
            args.chunked_prefill_size,
            args.max_prefill_seqs,
            adapter_slots=self.lora,
            prefix_cache=self.prefix_cache,
        )
        self.lora_builder = self.lora.lora_batch if self.lora else (lambda token_slots: None)
        warmup_start = time.monotonic()
        if not args.skip_precompile:
            lora_for = self.lora.padding_batches if self.lora else (lambda num_tokens: [None])
            self.runner.warmup(self.buckets, lora_for, progress=startup_progress)
        self.warmup_s = time.monotonic() - warmup_start
        self.num_compilations_after_warmup_start = self.compile_counter.count
        self.num_requests_served = 0
        self.step_stats = StepStats()
        self.last_step_idle = False
        self.in_flight: LaunchedStep | None = None  # the step launched by the last `step()`, tokens not yet read

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest) -> None:
        """Admit a tokenized request; raises ValueError (sent back as that request's error) if it can never fit."""
        check_context_length(len(request.input_ids), request.sampling.max_new_tokens, self.context_length)
        max_len = len(request.input_ids) + request.sampling.max_new_tokens
        if max_len > self.max_total_tokens:
            raise ValueError(
                f"request needs {max_len} KV tokens but the KV cache holds {self.max_total_tokens}; "
                "lower max_new_tokens or restart with a larger --max-total-tokens"
            )
        seed = (
            request.sampling.seed
            if request.sampling.seed is not None
            else self.args.random_seed * 1_000_003 + self.num_requests_served
        )
        self.num_requests_served += 1
        self.scheduler.add(
            Req(
                rid=request.rid,
                input_ids=list(request.input_ids),
                sampling=request.sampling,
                seed=seed,
                return_logprob=request.return_logprob,
                logprob_start_len=request.logprob_start_len,
                top_logprobs_num=request.top_logprobs_num,
                lora_slot_key=request.lora_id,
                arrival_time=request.arrival_time,
            )
        )
        if self.lora is not None:
            self.lora.prefetch(request.lora_id)

    def pop_request_errors(self) -> list[tuple[str, str]]:
        """(rid, message) of requests the scheduler rejected since the last call (their adapter cannot be read)."""
        return [(req.rid, message) for req, message in self.scheduler.pop_rejected()]

    def abort(self, rid: str) -> EngineOutput | None:
        req = self.scheduler.abort(rid)
        if req is None:
            return None
        req.finish_reason = {"type": "abort", "message": "aborted by the client"}
        return self._output_of(req)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[dict]:
        """Schedule and launch a step, then finish the step launched before it (overlap schedule: the device runs
        the new step while the host takes the previous one's tokens); without overlap, finish the new step."""
        start = time.perf_counter()
        prev, self.in_flight = self.in_flight, None
        batch = self.scheduler.schedule()
        self.last_step_idle = batch is None and prev is None  # requests may be waiting on an adapter prefetch or pages
        outputs: list[dict] = []
        if batch is None:
            return self._finish(prev) if prev is not None else outputs
        scheduled = time.perf_counter()
        forward_batch = batch.to_forward_batch(self.buckets, self.args.page_size, self.lora_builder)
        prepared = time.perf_counter()
        launched = self._launch(batch, forward_batch, prev)
        if prev is not None:
            outputs += self._finish(prev)
        self._advance(launched)
        if self.args.disable_overlap_schedule:
            outputs += self._finish(launched)
        else:
            self.in_flight = launched
        self.step_stats.record(
            batch.kind,
            batch.num_tokens,
            batch.num_decode_rows,
            scheduled - start,
            prepared - scheduled,
            time.perf_counter() - prepared,
        )
        return outputs

    def _launch(self, batch: ScheduleBatch, forward_batch: ForwardBatch, prev: LaunchedStep | None) -> LaunchedStep:
        """Dispatch the forward and the sampling; only prompt logprobs (rare) wait for the device here."""
        prev_ids = prev.sampled.carried_ids if prev is not None and prev.sampled is not None else None
        hidden, last_hidden = self.runner.forward(forward_batch, prev_ids)
        if batch.num_decode_rows < len(batch.reqs):  # prefill chunks: prompt logprobs, if asked
            self._collect_prompt_logprobs(batch, hidden, forward_batch.num_tokens)
        sampled = None
        if batch.sampling_reqs():
            sampled = self.runner.launch_sample(
                last_hidden,
                batch.to_sampling_batch(forward_batch.num_seqs),
                self._logit_adjustments(batch, forward_batch.num_seqs),
                prev_ids,
            )
        return LaunchedStep(batch, sampled)

    def _logit_adjustments(self, batch: ScheduleBatch, num_seqs: int) -> LogitAdjustments | None:
        """The step's logit adjustments (applied on the device); None when no sampling request adjusts its logits.
        A request short of min_new_tokens may not sample its stop or EOS ids (the token of this step is its
        len(output_ids)-th: tokens still in flight are counted). A token of a request in flight is counted by its
        penalties on the device, from its row in the previous step's sampled ids."""
        if not any(r.sampling.adjusts_logits or len(r.output_ids) < r.sampling.min_new_tokens for r in batch.reqs):
            return None  # the common case: nothing to build
        rows: list[LogitRow | None] = []
        for req, n in zip(batch.reqs, batch.num_new_tokens):
            if req.num_computed + n < req.seq_len:  # a prefill chunk that samples nothing
                rows.append(None)
                continue
            params = req.sampling
            banned: tuple[int, ...] = ()
            if len(req.output_ids) < params.min_new_tokens:
                eos = () if params.ignore_eos else tuple(self.stop_checker.eos_token_ids)
                banned = tuple(sorted(set(params.stop_token_ids) | set(eos)))
            in_flight_row = req.pending_row if req.has_pending_token and params.uses_penalties else -1
            rows.append(LogitRow(req.input_ids, req.resolved_output_ids, params, banned, in_flight_row))
        return pack_logit_rows(rows, num_seqs, self.buckets.logit_entry_sizes(num_seqs))

    def _advance(self, step: LaunchedStep) -> None:
        """Move the step's requests past its tokens before they reach the host: each sampled token is pending."""
        for i, (req, n) in enumerate(zip(step.batch.reqs, step.batch.num_new_tokens)):
            if req.finished:  # stopped by the previous step's token, or aborted: this step's token is dropped
                continue
            req.num_computed += n
            if req.num_computed == req.seq_len:  # a decode row, or a chunk that ends its prefill
                req.output_ids.append(PENDING_TOKEN)
                req.pending_row = i

    def _collect_prompt_logprobs(self, batch: ScheduleBatch, hidden, num_tokens: int) -> None:
        wanted = [(i, r) for i, r in enumerate(batch.reqs) if r.return_logprob and r.num_computed < len(r.input_ids)]
        if not wanted:
            return
        targets = np.zeros(num_tokens, np.int32)
        starts = np.cumsum([0] + batch.num_new_tokens)
        for i, req in enumerate(batch.reqs):
            for j in range(batch.num_new_tokens[i]):
                nxt = req.num_computed + j + 1
                if nxt < req.seq_len:
                    targets[starts[i] + j] = req.all_ids[nxt]
        num_top = max(r.top_logprobs_num for _, r in wanted)
        result = self.runner.prompt_logprobs(hidden, targets, MAX_TOP_LOGPROBS if num_top else 0)
        for i, req in wanted:
            if req.next_prompt_logprob_pos < 0:  # first chunk: start at logprob_start_len
                req.next_prompt_logprob_pos = req.prompt_logprob_start
                if req.next_prompt_logprob_pos == 0:
                    req.input_token_logprobs.append((None, req.input_ids[0], None))
                    req.next_prompt_logprob_pos = 1
            for j in range(batch.num_new_tokens[i]):
                position = req.num_computed + j + 1  # the prompt token this row predicts
                if position != req.next_prompt_logprob_pos or position >= len(req.input_ids):
                    continue  # before logprob_start_len, or already collected before a preemption
                row = starts[i] + j
                top = _top_list(result["top_ids"][row], result["top_logprobs"][row], req.top_logprobs_num)
                req.input_token_logprobs.append((float(result["logprobs"][row]), req.input_ids[position], top))
                req.next_prompt_logprob_pos += 1

    def _finish(self, step: LaunchedStep) -> list[dict]:
        """The step's sampled tokens reach the host: replace each pending token, check stops, emit outputs."""
        sampled = self.runner.fetch(step.sampled) if step.sampled is not None else None
        outputs = []
        for i, req in enumerate(step.batch.reqs):
            if req.finished:  # finished before this step's token landed: it was sent then
                continue
            if req.has_pending_token:  # this step's token (the next step's requests are not advanced yet)
                token = int(sampled["next_ids"][i])
                req.output_ids[-1] = token
                if req.return_logprob:
                    top = _top_list(sampled["top_ids"][i], sampled["top_logprobs"][i], req.top_logprobs_num)
                    req.output_token_logprobs.append((float(sampled["next_logprobs"][i]), token, top))
                req.finish_reason = self.stop_checker.check(req, self.context_length)
                if req.finish_reason is not None:
                    self.scheduler.finish(req)
            if (
                req.output_ids[req.num_sent_outputs :]
                or req.finished
                or len(req.input_token_logprobs) > req.num_sent_input_logprobs
            ):
                outputs.append(self._output_of(req))
        return outputs

    def _output_of(self, req: Req) -> EngineOutput:
        output_ids = req.resolved_output_ids  # an abort can come while a token is in flight
        out = EngineOutput(
            rid=req.rid,
            new_ids=output_ids[req.num_sent_outputs :],
            new_output_logprobs=req.output_token_logprobs[req.num_sent_outputs :] if req.return_logprob else [],
            new_input_logprobs=req.input_token_logprobs[req.num_sent_input_logprobs :],
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(output_ids),
            cached_tokens=req.cached_tokens,
            finish_reason=req.finish_reason,
        )
        req.num_sent_outputs = len(output_ids)
        req.num_sent_input_logprobs = len(req.input_token_logprobs)
        return out

    def fail_running(self, message: str) -> list[EngineOutput]:
        """After a step raised: finish every running request with an error, keep the waiting ones (but those
        preempted while a token of theirs was in flight: that token is lost with the step)."""
        self.in_flight = None
        outputs = []
        lost_token = [r for r in self.scheduler.waiting if r.has_pending_token]
        for req in list(self.scheduler.running) + lost_token:
            self.scheduler.finish(req)
            req.finish_reason = {"type": "abort", "message": message}
            outputs.append(self._output_of(req))
        if self.prefix_cache is not None:  # the failed step may not have written the K/V its requests' pages claim
            self.prefix_cache.evict(self.prefix_cache.num_cached)
        return outputs

    def rpc_server_info(self) -> dict:
        return self.server_info()

    def rpc_load_lora(
        self, lora_id: str, lora_name: str, lora_path: str, pinned: bool = False, confined: bool = False
    ) -> dict:
        if self.lora is None:
            raise ValueError("LoRA is not enabled; restart with --enable-lora or --lora-paths")
        adapter = self.lora.register(
            LoRARef(lora_name=lora_name, lora_path=lora_path, pinned=pinned, lora_id=lora_id, confined=confined)
        )
        return {"rank": adapter.rank, "target_modules": sorted(adapter.target_modules)}

    def rpc_load_lora_tensors(
        self, ref: LoRARef, tensors_path: str, config: dict | None, replaces: str | None = None
    ) -> dict:
        """An adapter from memory (a safetensors-layout file in shared memory + config dict), or an update: the next version of adapter
        `replaces`, with its config unless one is given. The old version keeps serving its running requests until
        the frontend unloads it; it gives up its pin so that the new version can take one."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled; restart with --enable-lora or --lora-paths")
        old = self.lora.refs.get(replaces) if replaces is not None else None
        if replaces is not None and old is None:
            raise ValueError(f"adapter '{ref.lora_name}': the version to update is no longer loaded; load it again")
        adapter = self.lora_setup.from_memory(
            ref, tensors_path, config if config is not None else self.lora_setup.config_of(old)
        )
        if old is not None:
            self.lora.pool.pinned.discard(old.lora_id)
        try:
            self.lora.register(ref)
        except Exception:
            self.lora_setup.forget(ref.lora_id)
            if old is not None and old.pinned:
                self.lora.pool.pinned.add(old.lora_id)
            raise
        return {"rank": adapter.rank, "target_modules": sorted(adapter.target_modules)}

    def rpc_unload_lora(self, lora_id: str) -> dict:
        if self.lora is None:
            raise ValueError("LoRA is not enabled")
        self.lora.unregister(lora_id)
        self.lora_setup.forget(lora_id)
        return {}

    def server_info(self) -> dict:
        return {
            "model_path": self.cfg.model_path,
            "architecture": self.cfg.architecture,
            "vocab_size": self.cfg.vocab_size,
            "context_length": self.context_length,
            "max_total_tokens": self.max_total_tokens,
            "step_memory_reserve_bytes": self.runner.step_memory.reserve_bytes if self.runner.step_memory else 0,
            "kv_pages_total": self.allocator.num_usable,
            "kv_pages_used": self.scheduler.num_pages_held,
            "kv_pages_cached": self.prefix_cache.num_cached if self.prefix_cache is not None else 0,
            "prefix_cache_hit_tokens": self.scheduler.num_cached_tokens,
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compilations": self.compile_counter.count,
            "num_compilations_after_warmup": self.compile_counter.count - self.num_compilations_after_warmup_start,
            "warmup_s": self.warmup_s,
            "devices": [str(d) for d in self.mesh.devices.flat],
            "step_stats": self.step_stats.as_dict(),
            "lora": self.lora.stats() if self.lora else None,
            "loras": [dataclasses.asdict(r) for r in self.lora.refs.values()] if self.lora else [],
            "max_lora_rank": self.lora.max_rank if self.lora else None,
            "buckets": {"tokens": list(self.buckets.tokens), "seqs": [s for s, _ in self.buckets.shapes()]},
            "attention_backend": self.runner.attention_backend,
            "timestamp": time.time(),
        }


def _top_list(ids: np.ndarray, logprobs: np.ndarray, num: int) -> list | None:
    if num <= 0:
        return None
    return [(float(lp), int(t)) for lp, t in zip(logprobs[:num], ids[:num])]
