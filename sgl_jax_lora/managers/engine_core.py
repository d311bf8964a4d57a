"""EngineCore: the device loop of one engine process: admit requests, plan, prepare, launch, finish.

Flow of one step (`step()`), overlap schedule (the default):
    plan = scheduler.schedule()                           # decode rows + prefill chunks, one ragged step, and the
                                                          # adapter in each device slot: host bookkeeping only,
                                                          # while the previous step still runs on the device
    forward_batch = _prepare(plan)                        # apply it: adapter loads into device slots
                                                          # (LoRAManager.apply), the batch padded to a bucket
    launched = _launch(plan, forward_batch, prev)         # forward + sampling dispatched, not waited for; tokens
                                                          # of the previous step are read on the device
    outputs = _finish(prev, _fetch(prev))                 # its tokens reach the host: token-level stop checks
                                                          # (stop strings are the frontend's), free pages
    _advance(launched)                                    # the new step's tokens are in flight (in_flight.py), its
                                                          # chunks' full pages in the prefix cache
so the host's work for step N+1 overlaps the device's work for step N. With --disable-overlap-schedule a step
finishes itself before `step()` returns. Penalties keep the overlap: a request's token still in flight is counted on
the device (sampling/logit_adjustments.py). The tokens in flight live in `tokens_in_flight` (InFlightTokens: request
-> step and row), never as placeholders in a request's output_ids. Requests arrive as GenerateRequest and leave as
incremental EngineOutput messages (managers/io_struct.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.distributed.leader_runner import make_model_runner
from sgl_jax_lora.layers.attention import resolve_attention_backend, runs_decode_programs
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.lora_setup import LoRASetup
from sgl_jax_lora.managers import adapter_commands
from sgl_jax_lora.managers.in_flight import InFlightTokens
from sgl_jax_lora.managers.io_struct import AdapterLoaded, EngineOutput, GenerateRequest, Unloaded
from sgl_jax_lora.managers.kv_capacity import check_fits_kv_cache, warn_kv_capacity
from sgl_jax_lora.managers.lora_manager import build_lora_manager
from sgl_jax_lora.managers.prompt_limits import check_context_length
from sgl_jax_lora.managers.prompt_logprobs import collect_prompt_logprobs, finite_logprob, top_list
from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch
from sgl_jax_lora.managers.scheduler import Scheduler
from sgl_jax_lora.managers.step_stats import StepStats
from sgl_jax_lora.managers.stop_checker import StopChecker, eos_token_ids
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator
from sgl_jax_lora.mem_cache.prefix_cache import PrefixCache
from sgl_jax_lora.model_executor.compile_counter import CompileCounter
from sgl_jax_lora.model_executor.model_runner import LaunchedSample
from sgl_jax_lora.models.forward_batch import ForwardBatch
from sgl_jax_lora.sampling.logit_adjustments import LogitAdjustments, LogitRow, pack_logit_rows
from sgl_jax_lora.sampling.sampling_params import MAX_LOGIT_BIAS_IDS, MAX_STOP_TOKEN_IDS
from sgl_jax_lora.server_args import ServerArgs
from sgl_jax_lora.utils.gc_freeze import collector_stats
from sgl_jax_lora.utils.progress import startup_progress

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step on the device whose sampled tokens have not been read yet."""

    number: int  # steps are numbered from 1 in launch order
    batch: ScheduleBatch
    sampled: LaunchedSample | None  # None: no request samples (prefill chunks only)


class EngineCore:
    def __init__(self, args: ServerArgs, model_path: str, tokenizer_eos: tuple[int, ...] | None = None):
        """`tokenizer_eos`: the tokenizer's EOS id as the frontend read it; None: read here (stop_checker.py)."""
        self.compile_counter = CompileCounter()
        self.args = args
        self.cfg = ModelConfig.from_model_path(model_path)
        self.cfg.check_tensor_parallel(args.tp_size)
        self.context_length = self.cfg.context_length(args.context_length, warn=True)
        self.mesh = make_mesh(args.tp_size)
        self.lora_setup = LoRASetup(args, model_path, self.mesh) if args.enable_lora else None
        self.stop_checker = StopChecker(eos_token_ids(self.cfg, tokenizer_eos, args.tokenizer_path or model_path))
        # a request's logit-adjustment entries: distinct prompt and output ids, logit_bias ids, banned ids
        max_logit_entries = min(self.cfg.vocab_size, self.context_length + MAX_LOGIT_BIAS_IDS) + MAX_STOP_TOKEN_IDS
        max_logit_entries += len(self.stop_checker.eos_token_ids)
        step_token_budget = args.step_token_budget(self.context_length)  # the scheduler keeps it (chunk_budget)
        backend = resolve_attention_backend(args.attention_backend, self.mesh.devices.flat[0].platform)
        self.buckets = Buckets.build(
            args.max_running_requests,
            step_token_budget,
            self.context_length,
            args.page_size,
            args.token_buckets,
            max_logit_entries_per_row=max_logit_entries,
            decode_programs=runs_decode_programs(args.decode_step_programs, backend),
        )
        self.runner = make_model_runner(args, self.cfg, self.mesh, self.buckets, self.lora_setup)  # multi-host: leader
        self.lora = build_lora_manager(self.lora_setup, self.runner) if self.lora_setup else None
        self.lora_builder = self.lora.lora_batch if self.lora else (lambda token_slots: None)
        warmup_start = time.monotonic()
        if not args.skip_precompile:  # compiles, then places the KV cache (its final size), then runs each program
            lora_for = self.lora.padding_batches if self.lora else (lambda num_tokens: [None])
            self.runner.warmup(self.buckets, lora_for, progress=startup_progress)
        self.runner.place_kv_cache()
        self.warmup_s = time.monotonic() - warmup_start
        self.allocator = PageAllocator(self.runner.num_pages, args.page_size)
        self.max_total_tokens = self.allocator.num_usable * args.page_size
        warn_kv_capacity(self.context_length, args.max_running_requests, self.max_total_tokens, args.page_size)
        self.prefix_cache = None if args.disable_prefix_cache else PrefixCache(self.allocator)
        self.scheduler = Scheduler(
            self.buckets,
            self.allocator,
            args.max_running_requests,
            step_token_budget,
            args.max_prefill_seqs,
            adapter_slots=self.lora,
            prefix_cache=self.prefix_cache,
            sliding_window=self.cfg.served_within(self.context_length).page_release_window,
            kv_headroom=args.kv_headroom,
        )
        self.num_compilations_after_warmup_start = self.compile_counter.count
        self.num_requests_served = 0
        self.step_stats = StepStats()
        self.last_step_idle = False
        self.in_flight: LaunchedStep | None = None  # the step launched by the last `step()`, tokens not yet read
        self.tokens_in_flight = InFlightTokens()  # its requests' sampled tokens, by request: step and row
        self.num_steps_launched = 0

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest) -> None:
        """Admit a tokenized request; raises ValueError (sent back as that request's error) if it can never fit."""
        check_context_length(len(request.input_ids), request.sampling.max_new_tokens, self.context_length)
        check_fits_kv_cache(len(request.input_ids) + request.sampling.max_new_tokens, self.max_total_tokens)
        seed = request.sampling.seed
        seed = self.args.random_seed * 1_000_003 + self.num_requests_served if seed is None else seed
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
                priority=request.priority,
                arrival_time=request.arrival_time,
            )
        )
        if self.lora is not None:
            self.lora.prefetch(request.lora_id, request.priority)

    def pop_request_errors(self) -> list[tuple[str, str]]:
        """(rid, message) of requests the scheduler rejected since the last call (their adapter cannot be read)."""
        return [(req.rid, message) for req, message in self.scheduler.pop_rejected()]

    def abort(self, rid: str) -> EngineOutput | None:
        if (req := self.scheduler.abort(rid)) is None:
            return None
        req.finish_reason = {"type": "abort", "message": "aborted by the client"}
        return self._output_of(req)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Plan a step, prepare and launch it, then finish the step launched before it (overlap schedule: the
        device runs the new step while the host takes the previous one's tokens); without overlap, finish the new
        step."""
        prev, self.in_flight = self.in_flight, None
        start = time.perf_counter()
        self.step_stats.begin(start)
        plan = self.scheduler.schedule()  # which requests run, which adapter goes in which slot: no device writes
        self.last_step_idle = plan is None and prev is None  # requests may be waiting on an adapter prefetch or pages
        if plan is None:
            return self._finish(prev, self._fetch(prev)[0])
        planned = time.perf_counter()
        forward_batch = self._prepare(plan)  # the plan's slot writes, the padded host batch
        prepared = time.perf_counter()
        launched = self._launch(plan, forward_batch, prev)  # forward + sampling dispatched, not waited for
        sampled, wait_s = self._fetch(prev)  # the previous step's tokens reach the host
        outputs = self._finish(prev, sampled)
        self._advance(launched)  # this step's tokens are in flight
        if self.args.disable_overlap_schedule:
            sampled, waited = self._fetch(launched)
            wait_s += waited
            outputs += self._finish(launched, sampled)
        else:
            self.in_flight = launched
        ended = time.perf_counter()
        elapsed = (planned - start, prepared - planned, ended - prepared, wait_s)
        busy = ended if self.scheduler.num_active else None  # the gap to the next step counts while requests remain
        self.step_stats.record(plan.kind, plan.num_tokens, plan.num_decode_rows, *elapsed, ended=busy)
        return outputs

    def _prepare(self, plan: ScheduleBatch) -> ForwardBatch:
        """Apply the plan: its adapter loads into their device slots (the step's only device writes before launch),
        then the step padded to its bucket on the host, its decode rows reading the tokens in flight."""
        if self.lora is not None:
            self.lora.apply(plan.slot_writes)
        return plan.to_forward_batch(self.buckets, self.args.page_size, self.lora_builder, self.tokens_in_flight)

    def _launch(self, batch: ScheduleBatch, forward_batch: ForwardBatch, prev: LaunchedStep | None) -> LaunchedStep:
        """Dispatch the forward and the sampling; only prompt logprobs (rare) wait for the device here."""
        prev_ids = prev.sampled.carried_ids if prev is not None and prev.sampled is not None else None
        hidden, last_hidden = self.runner.forward(forward_batch, prev_ids)
        if batch.num_decode_rows < len(batch.reqs):  # prefill chunks: prompt logprobs, if asked
            collect_prompt_logprobs(self.runner, batch, hidden, forward_batch.num_tokens)
        sampled = None
        if batch.num_decode_rows or batch.sampling_reqs():  # decode rows always sample
            sampled = self.runner.launch_sample(
                last_hidden,
                batch.to_sampling_batch(forward_batch.num_seqs),
                self._logit_adjustments(batch, forward_batch.num_seqs),
                prev_ids,
            )
        self.num_steps_launched += 1
        return LaunchedStep(self.num_steps_launched, batch, sampled)

    def _logit_adjustments(self, batch: ScheduleBatch, num_seqs: int) -> LogitAdjustments | None:
        """The step's logit adjustments (applied on the device); None when no sampling request adjusts its logits.
        A request short of min_new_tokens may not sample its stop or EOS ids (the token of this step is its
        num_output_tokens-th: a token in flight is counted). A request's token in flight is counted by its
        penalties on the device, from its row in the previous step's sampled ids."""
        if not any(r.sampling.adjusts_logits or r.num_output_tokens < r.sampling.min_new_tokens for r in batch.reqs):
            return None  # the common case: nothing to build
        rows: list[LogitRow | None] = []
        for req, n in zip(batch.reqs, batch.num_new_tokens):
            if req.num_computed + n < req.seq_len:  # a prefill chunk that samples nothing
                rows.append(None)
                continue
            params = req.sampling
            banned: tuple[int, ...] = ()
            if req.num_output_tokens < params.min_new_tokens:
                eos = () if params.ignore_eos else tuple(self.stop_checker.eos_token_ids)
                banned = tuple(sorted(set(params.stop_token_ids) | set(eos)))
            in_flight_row = self.tokens_in_flight.row(req) if params.uses_penalties else -1
            rows.append(LogitRow(req.input_ids, req.output_ids, params, banned, in_flight_row))
        return pack_logit_rows(rows, num_seqs, self.buckets.logit_entry_sizes(num_seqs))

    def _advance(self, step: LaunchedStep) -> None:
        """Move the step's requests past its tokens before they reach the host: each sampled token is in flight; a
        prefill chunk's full pages join the prefix cache now (requests admitted from the next step on share them)."""
        add, cache = self.tokens_in_flight.add, self.prefix_cache
        for i, (req, n) in enumerate(zip(step.batch.reqs, step.batch.num_new_tokens)):
            if req.finish_reason is not None:  # stopped by the previous step's token, or aborted: token dropped
                continue
            req.num_computed += n
            if cache is not None and i >= step.batch.num_decode_rows:
                cache.insert(req.lora_slot_key, req.all_ids, req.num_computed, req.pages)
            if req.num_computed == req.seq_len:  # a decode row, or a chunk that ends its prefill
                add(req, step.number, i)

    def _fetch(self, step: LaunchedStep | None) -> tuple[dict | None, float]:
        """The step's sampled ids on the host, and the seconds the host waited for the device to give them."""
        if step is None or step.sampled is None:
            return None, 0.0
        start = time.perf_counter()
        sampled = self.runner.fetch(step.sampled)
        return sampled, time.perf_counter() - start

    def _finish(self, step: LaunchedStep | None, sampled: dict | None) -> list[EngineOutput]:
        """The step's sampled tokens (`_fetch`) reach its requests: each request's token in flight lands, stops are
        checked, outputs emitted."""
        if step is None:
            return []
        outputs = []
        next_ids = sampled["next_ids"].tolist() if sampled is not None else []  # Python ints, converted at once
        for req in step.batch.reqs:
            token_in_flight = self.tokens_in_flight.pop(req)  # this step's (the next step's are not advanced yet)
            if req.finish_reason is not None:  # finished before this step's token landed: sent then, token dropped
                continue
            if token_in_flight is not None:
                assert token_in_flight.step == step.number, (req.rid, token_in_flight, step.number)
                i = token_in_flight.row
                token = next_ids[i]
                req.output_ids.append(token)
                if req.return_logprob:
                    top = top_list(sampled["top_ids"][i], sampled["top_logprobs"][i], req.top_logprobs_num)
                    req.output_token_logprobs.append((finite_logprob(sampled["next_logprobs"][i]), token, top))
                req.finish_reason = self.stop_checker.check(req, self.context_length)
                if req.finish_reason is not None:
                    self.scheduler.finish(req)
            if (
                len(req.output_ids) > req.num_sent_outputs
                or req.finish_reason is not None
                or len(req.input_token_logprobs) > req.num_sent_input_logprobs
            ):
                outputs.append(self._output_of(req))
        return outputs

    def _output_of(self, req: Req) -> EngineOutput:
        output_ids = req.output_ids  # the tokens on the host (an abort can come while a token is in flight)
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
        lost_token = [r for r in self.scheduler.waiting if r in self.tokens_in_flight]
        for req in list(self.scheduler.running) + lost_token:
            self.scheduler.finish(req)
            req.finish_reason = {"type": "abort", "message": message}
            outputs.append(self._output_of(req))
        self.tokens_in_flight.clear()
        if self.prefix_cache is not None:  # the failed step may not have written the K/V its requests' pages claim
            self.prefix_cache.evict(self.prefix_cache.num_cached)
        return outputs

    def rpc_server_info(self) -> dict:
        return self.server_info()

    def rpc_load_lora(
        self, lora_id: str, lora_name: str, lora_path: str, pinned: bool = False, confined: bool = False, summary=None
    ) -> AdapterLoaded:
        ref = LoRARef(lora_name=lora_name, lora_path=lora_path, pinned=pinned, lora_id=lora_id, confined=confined)
        return adapter_commands.load_from_dir(self.lora, ref, summary)

    def rpc_load_lora_tensors(
        self,
        ref: LoRARef,
        tensors_paths: list[str],
        config: dict | None,
        replaces: str | None = None,
        checked_finite: bool = False,
    ) -> AdapterLoaded:
        return adapter_commands.load_from_memory(
            self.lora, self.lora_setup, ref, tensors_paths, config, replaces, checked_finite
        )

    def rpc_unload_lora(self, lora_id: str) -> Unloaded:
        return adapter_commands.unload(self.lora, self.lora_setup, lora_id)

    def server_info(self) -> dict:
        return {
            "model_path": self.cfg.model_path,
            "architecture": self.cfg.architecture,
            "vocab_size": self.cfg.vocab_size,
            "eos_token_ids": sorted(self.stop_checker.eos_token_ids),  # the model config's and the tokenizer's
            "context_length": self.context_length,
            "step_token_budget": self.scheduler.chunk_budget,  # --chunked-prefill-size as the steps get it
            "token_buckets": list(self.buckets.tokens),
            "max_total_tokens": self.max_total_tokens,
            "step_memory_reserve_bytes": self.runner.step_memory.reserve_bytes if self.runner.step_memory else 0,
            "kv_pages_total": self.allocator.num_usable,
            "kv_pages_used": self.scheduler.num_pages_held,
            "kv_pages_cached": self.prefix_cache.num_cached if self.prefix_cache is not None else 0,
            "prefix_cache_hit_tokens": self.scheduler.num_cached_tokens,
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_headroom_ratio": round(self.scheduler.headroom.ratio, 4),  # 0 until the KV cache ran short
            "num_compilations": self.compile_counter.count,
            "num_compilations_after_warmup": self.compile_counter.count - self.num_compilations_after_warmup_start,
            "warmup_s": self.warmup_s,
            "devices": [str(d) for d in self.mesh.devices.flat],
            "step_stats": self.step_stats.as_dict(),
            "lora": self.lora.stats() if self.lora else None,
            "loras": [dataclasses.asdict(r) for r in self.lora.refs.values()] if self.lora else [],
            "max_lora_rank": self.lora.max_rank if self.lora else None,
            "buckets": {
                "tokens": list(self.buckets.tokens),
                "seqs": [s for s, _ in self.buckets.shapes()],
                "decode_programs": self.buckets.decode_programs,
            },
            "attention_backend": self.runner.attention_backend,
            "sliding_windows": list(self.cfg.served_within(self.context_length).sliding_windows),  # 0: full layer
            "kv_cache_dtype": str(self.runner.kv_dtype),  # --kv-cache-dtype as resolved ('auto': the model's)
            "engine_gc": collector_stats(),  # the engine process's garbage collector (utils/gc_freeze.py)
            "timestamp": time.time(),
        }
