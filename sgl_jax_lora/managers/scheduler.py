"""Scheduler: continuous batching over a waiting queue and a running list (host only).

Each step is one ragged batch: first a decode row (one token) for every running request past its prefill, grouped
by adapter slot, then prefill chunks (continuing chunked prefills, then admissions) under the step's token budget,
--chunked-prefill-size less the decode rows (at least MIN_PREFILL_TOKENS, so prompts progress under a full decode
batch). An admission never stalls the running requests: they decode in the same step. KV pages are allocated as
tokens arrive (managers/request_pages.py); a decode row out of pages preempts the newest running request, itself if
it is the newest (pages freed, recomputed later). After preemptions admission leaves headroom for the running
requests' next tokens (kv_headroom.py).

Scheduling only plans: `schedule()` returns the step's ScheduleBatch, with the adapter loads it needs
(`slot_writes`), and writes nothing to the device; EngineCore applies the loads before it launches the step.

LoRA: an `AdapterSlots` object (managers/adapter_slots.py, LoRAManager) decides whether a request's adapter can join the
step (reserving its slot in the plan); when it cannot, the scheduler skips ahead to requests that can (no head-of-line blocking), and a request
whose adapter is not on the device may not evict one that other waiting requests want (no thrash). When adapters
outnumber the free slots, admission packs the batch (managers/adapter_packing.py): the adapters with the most waiting
requests fill the batch, and each slot left over goes to the adapter with the fewest, so rarely used adapters take
turns on the spare slots all along instead of queueing up at the end of a backlog, where the slot limit, not the
running-request limit, would cap the batch (docs/lora.md "Scheduling and fairness"). Otherwise admission keeps
arrival order. The bound: a request overtaken by more than a full batch (`max_running`) of requests that arrived
after it is starved; it goes first and may evict any adapter that no running request uses. If every slot is held
by running requests, it drains one: admission stops feeding that adapter (the one the fewest waiting requests want,
then the soonest to finish; never a pinned one) and goes on admitting the others, so the batch stays full while
that slot runs dry for the starved request. A starved request short of KV pages blocks admission of others until
it gets in. So nothing waits forever.

Priority (--scheduling-policy priority; every request's priority is 0 under fcfs): the waiting queue is kept by
priority class, the lowest value first, and admission goes through the classes in that order, each as above; a
request's starvation bound counts only requests of its own class (a better class always goes first, as in vLLM), and
a request of a later class neither evicts nor drains an adapter that a better class waits for. A decode row out of pages
preempts the running request of the least urgent class, the newest of it, the row itself included (decode rows take
their pages most urgent first).

Prefix cache (mem_cache/prefix_cache.py, unless --disable-prefix-cache): a request entering with no pages takes the
cached pages of its longest cached prefix under its adapter and prefills only the rest; prefill chunks share their
full pages once launched (EngineCore), released requests leave theirs, and unheld cached pages go when pages run short.
A waiting request whose first page another admission computes in the same step waits for the next step, where it
finds that page cached: n samples of one prompt, or a burst sharing a system prompt, prefill it once (SGLang's
in-batch prefix caching). With a sliding window on every layer (`sliding_window`), running requests give back their
pages below it as each step is planned (mem_cache/window_pages.py), and a prefix match needs only the pages of its
last window.

Under the overlap schedule (engine_core.py) `schedule()` runs while the previous step is in flight: its
requests are already advanced, their sampled tokens in flight (managers/in_flight.py). A request may then turn out finished (a stop
token) after the next step took it; that step's token for it is dropped.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import operator
from collections import Counter, deque

from sgl_jax_lora.configs.buckets import MIN_PREFILL_TOKENS, Buckets
from sgl_jax_lora.managers.adapter_packing import adapter_to_drain, admission_order
from sgl_jax_lora.managers.adapter_slots import AdapterSlots
from sgl_jax_lora.managers.kv_headroom import HEADROOM_AFTER_PREEMPTION, KVHeadroom
from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.managers.request_pages import RequestPages
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator
from sgl_jax_lora.mem_cache.prefix_cache import PrefixCache
from sgl_jax_lora.mem_cache.window_pages import drop_pages_below_window

URGENCY = operator.attrgetter("priority", "arrival_time", "arrival_seq")  # the lowest is the most urgent


@dataclasses.dataclass
class AdmissionPass:
    """What one step's admission has left and has done, across the priority classes it goes through."""

    budget: int  # prefill tokens left in the step
    num_chunks: int  # prefill chunks in the step so far
    max_chunks: int  # --max-prefill-seqs
    max_running: int  # running requests the step may hold
    wanted: frozenset  # adapters that waiting requests want (of every class)
    better_wanted: frozenset = frozenset()  # adapters that the waiting requests of the classes before want
    computing: set = dataclasses.field(default_factory=set)  # first pages this step's admissions compute
    blocked: bool = False  # a starved request short of KV pages holds back every request behind it
    headroom_tokens: float = 0.0  # KV tokens kept free for running and admitted requests' output (KVHeadroom)

    def stopped(self, num_running: int) -> bool:
        return self.blocked or self.budget <= 0 or self.num_chunks == self.max_chunks or num_running >= self.max_running


class Scheduler:
    def __init__(
        self,
        buckets: Buckets,
        allocator: PageAllocator,
        max_running_requests: int,
        chunked_prefill_size: int,
        max_prefill_seqs: int,
        adapter_slots: AdapterSlots | None = None,
        prefix_cache: PrefixCache | None = None,
        sliding_window: int | None = None,  # every layer's window, or the widest: pages below it are given back
        kv_headroom: float = HEADROOM_AFTER_PREEMPTION,  # KVHeadroom's ratio after a preemption (0: none)
    ):
        self.buckets = buckets
        self.allocator = allocator
        self.max_running = min(max_running_requests, buckets.max_seqs)
        self.chunk_budget = min(chunked_prefill_size, buckets.tokens[-1])
        self.max_prefill_seqs = max_prefill_seqs
        self.adapter_slots = adapter_slots
        self.prefix_cache = prefix_cache
        self.sliding_window = sliding_window
        self.pages = RequestPages(allocator, prefix_cache, sliding_window)  # the KV pages requests hold
        self.headroom = KVHeadroom(after_preemption=kv_headroom, window=sliding_window)
        self.num_cached_tokens = 0  # prompt tokens whose prefill the prefix cache saved
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_preemptions = 0
        self.arrivals = itertools.count(1)  # each added request's arrival_seq
        self.rejected: list[tuple[Req, str]] = []  # requests whose adapter cannot be served, with the reason
        # adapters admission does not feed, so their slots free up for a starved request
        self.draining: set[str] = set()

    # ---- queue operations --------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue req by priority class, then arrival time: one that reached the engine late (its adapter was being
        registered) goes ahead of requests of its class that arrived after it; those of one time keep their order."""
        req.arrival_seq = next(self.arrivals)
        key = (req.priority, req.arrival_time)
        if not self.waiting or (self.waiting[-1].priority, self.waiting[-1].arrival_time) <= key:
            self.waiting.append(req)
            return
        later = next(i for i, r in enumerate(self.waiting) if (r.priority, r.arrival_time) > key)
        self.waiting.insert(later, req)

    def abort(self, rid: str) -> Req | None:
        req = next((r for queue in (self.waiting, self.running) for r in queue if r.rid == rid), None)
        if req is not None:
            self._remove(req)
        return req

    def _remove(self, req: Req) -> None:
        """Take req out of whichever queue holds it and free its pages (abort, rejection, finish)."""
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)
        self.pages.release(req)
        if not self.waiting and not self.running:
            self.headroom.clear()

    def finish(self, req: Req) -> None:
        self._remove(req)  # running, or waiting when preempted while its last token was in flight

    @property
    def num_pages_held(self) -> int:
        """Pages that requests hold (cached pages no request holds are not counted: they are free to evict)."""
        return self.pages.num_held

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- step selection ----------------------------------------------------------------------
    def schedule(self) -> ScheduleBatch | None:
        """The plan of the next step: decode rows, then prefill chunks, and the adapter loads they need; None when
        nothing can run. Host bookkeeping only (queues, KV pages, the adapter slot table): no device writes."""
        batch = ScheduleBatch(reqs=[], num_new_tokens=[], token_slots=[])
        for req in self.running if self.sliding_window is not None else ():
            drop_pages_below_window(req.pages, req.num_computed, self.sliding_window, self.allocator, self.prefix_cache)
        if self.adapter_slots is not None:
            batch.adapters = self.adapter_slots.plan_step({r.lora_slot_key for r in self.running})
        preemptions_before = self.num_preemptions
        self._add_decode_rows(batch)
        batch.num_decode_rows = len(batch.reqs)
        self.headroom.after_step(preempted=self.num_preemptions > preemptions_before)
        budget = min(max(self.chunk_budget - batch.num_decode_rows, MIN_PREFILL_TOKENS), self.chunk_budget)
        budget = min(budget, self.buckets.tokens[-1] - batch.num_decode_rows)
        self._add_prefill_chunks(batch, budget, admit=self.num_preemptions == preemptions_before)
        return batch if batch.reqs else None

    def _add_prefill_chunks(self, batch: ScheduleBatch, budget: int, admit: bool) -> None:
        """Continue chunked prefills, then admit waiting requests, up to `budget` tokens and max_prefill_seqs
        chunks. A step that preempted admits no one (as vLLM's): the pages it freed are for the running requests'
        next tokens, not for a prompt that the next step would preempt again."""
        num_chunks = 0
        for req in [r for r in self.running if r.is_prefilling]:  # continue chunked prefills first
            if num_chunks == self.max_prefill_seqs or budget <= 0:
                break
            taken = self._try_add_chunk(batch, req, budget)
            budget -= taken
            num_chunks += taken > 0
        if not admit or not self.waiting or len(self.running) >= self.max_running:  # skip the O(waiting) work below
            return
        # adapters waiting requests want: not evicted for another (non-starved) request, drained last
        num_wanting = Counter(r.lora_slot_key for r in self.waiting) if self.adapter_slots is not None else Counter()
        self._end_finished_drains()
        admission = AdmissionPass(budget, num_chunks, self.max_prefill_seqs, self.max_running, frozenset(num_wanting))
        for candidates in self._priority_classes():  # headroom for the running requests as urgent as the class
            admission.headroom_tokens = self.headroom.tokens_for(self.running, as_urgent_as=candidates[0].priority)
            self._admit(batch, candidates, admission, num_wanting)
            if admission.stopped(len(self.running)):
                break
            admission.better_wanted |= {r.lora_slot_key for r in candidates}

    def _priority_classes(self) -> list[list[Req]]:
        """The waiting requests by priority class, the most urgent (lowest value) first; one class when every
        request has the same priority (always under --scheduling-policy fcfs). The queue is kept in class order."""
        return [list(group) for _, group in itertools.groupby(self.waiting, key=lambda r: r.priority)]

    def _admit(
        self, batch: ScheduleBatch, candidates: list[Req], admission: AdmissionPass, num_wanting: Counter
    ) -> None:
        """Admit waiting requests of one priority class, in the order adapter packing gives them, while the pass has
        room. A request of a better class has gone before, and its adapter is not evicted for this class's."""
        admitted = []
        order, planned = admission_order(candidates, self.running, self.adapter_slots, self.max_running, self._starved)
        for req in order:
            if admission.stopped(len(self.running)):
                break
            if req.lora_slot_key in self.draining:
                continue
            starved = self._starved(req)
            if admission.computing and not starved and self._first_page(req) in admission.computing:
                continue  # its prefix is computed in this step: the next one finds it cached (no second prefill)
            if starved:
                keep = admission.better_wanted
            elif req.lora_slot_key in planned:  # its slot was planned: it may evict an unplanned idle adapter
                keep = planned | admission.better_wanted
            else:
                keep = admission.wanted | planned
            reserve = self.allocator.pages_for(math.ceil(admission.headroom_tokens))
            if reserve and not self.pages.can_allocate(reserve + 1):  # an entering request needs a page: none fits
                break
            taken = self._try_add_chunk(batch, req, admission.budget, keep=keep, reserve=reserve)
            if taken == 0:
                # Could not join: skip ahead. A starved request whose adapter found no slot drains one (unless a
                # better class waits: draining would hold that class back); one short of pages blocks the rest.
                num_new, pages_needed = self.pages.chunk(req, admission.budget)
                if starved and num_new > 0 and self.pages.can_allocate(pages_needed + reserve):
                    if not admission.better_wanted:
                        self._drain_a_slot(num_wanting)
                else:
                    admission.blocked = starved
                continue
            admission.budget -= taken
            admission.num_chunks += 1
            admission.headroom_tokens += self.headroom.tokens_for([req])
            if req.num_computed == 0 and (first := self._first_page(req)) is not None:
                admission.computing.add(first)
            self.waiting.remove(req)
            self.running.append(req)
            admitted.append(req)
        if admitted:  # a waiting request is overtaken by each admitted one of its class that arrived after it
            admitted_times = sorted(r.arrival_time for r in admitted)
            for req in set(candidates) - set(admitted):
                req.times_overtaken += len(admitted_times) - bisect.bisect_right(admitted_times, req.arrival_time)

    def _first_page(self, req: Req) -> bytes | None:
        """The prefix-cache key of req's first page, where a later request could take that page from the cache: None
        without the cache, for a request that wants prompt logprobs (it takes no cached pages) or one shorter than a
        page and a token (a request prefills one token at least)."""
        if self.prefix_cache is None or req.prompt_logprob_start < len(req.input_ids):
            return None
        if len(req.all_ids) <= self.allocator.page_size:
            return None
        return self.prefix_cache.page_keys(req.lora_slot_key, req.all_ids, 1)[0]

    def _starved(self, req: Req) -> bool:
        """Overtaken by more than a full batch of requests that arrived after it: it goes first."""
        return req.times_overtaken > self.max_running

    def _end_finished_drains(self) -> None:
        """A drained adapter that no running request uses any more has freed its slot; with no starved request
        left waiting, no adapter needs draining."""
        if not any(self._starved(r) for r in self.waiting):
            self.draining.clear()
        self.draining &= {r.lora_slot_key for r in self.running}

    def _drain_a_slot(self, num_wanting: Counter) -> None:
        """Stop feeding one running adapter (`adapter_to_drain`), so that its slot runs dry for a starved request; one
        at a time, so the batch stays full. `num_wanting`: waiting requests per adapter at the pass's start."""
        if not self.draining and (victim := adapter_to_drain(self.running, self.adapter_slots, num_wanting)):
            self.draining.add(victim)

    def _try_add_chunk(
        self, batch: ScheduleBatch, req: Req, budget: int, keep: frozenset = frozenset(), reserve: int = 0
    ) -> int:
        """Add up to `budget` prefill tokens of req to batch; -> tokens added (0 if it cannot join). Adapters in
        `keep` are not evicted to make room for req's; `reserve` pages must stay free beside its own (KV headroom)."""
        num_new, pages_needed = self.pages.chunk(req, budget)
        if num_new <= 0 or not self.pages.can_allocate(pages_needed + reserve):
            return 0
        slot = self._adapter_slot(batch, req, keep)
        if slot is None:
            return 0
        if not req.pages and req.num_computed == 0:  # entering (new, or preempted): start after a cached prefix
            self.num_cached_tokens += self.pages.reuse_cached_prefix(req, budget, reserve)
            num_new, pages_needed = self.pages.chunk(req, budget)
        req.pages += self.pages.allocate(pages_needed)
        batch.reqs.append(req)
        batch.num_new_tokens.append(num_new)
        batch.token_slots.append(slot)
        return num_new

    def _add_decode_rows(self, batch: ScheduleBatch) -> None:
        """A decode row for every running request past its prefill that may still sample (one whose last allowed
        token is in flight under the overlap schedule finishes when it lands). Rows take their pages most urgent
        first, so a row short of a page preempts the least urgent request left, which may be the row itself."""
        rows = [r for r in self.running if not r.is_prefilling and not r.out_of_new_tokens]
        rows.sort(key=URGENCY)  # a re-admitted request is running again in its arrival's place
        for req in rows:
            if req.num_computed == 0:  # preempted while making room for a more urgent one (a decode row has K/V)
                continue
            if not self._ensure_decode_page(req, batch):
                continue
            slot = self._adapter_slot(batch, req)
            if slot is None:
                continue
            batch.reqs.append(req)
            batch.num_new_tokens.append(1)
            batch.token_slots.append(slot)
        batch.group_rows_by_slot()

    def _adapter_slot(self, batch: ScheduleBatch, req: Req, keep: frozenset = frozenset()) -> int | None:
        """The request's adapter slot in the planned step (0 = base), None if it cannot join now. An adapter that
        can never be served (its files became unreadable after registration) rejects that request alone."""
        if self.adapter_slots is None:
            return 0
        try:
            return self.adapter_slots.reserve(batch.adapters, req.lora_slot_key, keep)
        except ValueError as e:
            self._remove(req)
            self.rejected.append((req, str(e)))
            return None

    def pop_rejected(self) -> list[tuple[Req, str]]:
        rejected, self.rejected = self.rejected, []
        return rejected

    def _ensure_decode_page(self, req: Req, batch: ScheduleBatch) -> bool:
        needed = self.allocator.pages_for(req.seq_len) - len(req.pages)
        while needed > 0 and not self.pages.can_allocate(needed):
            placed = set(batch.reqs)  # the rows placed so far are more urgent (requests hash by identity)
            victim = max((r for r in self.running if r not in placed), key=URGENCY)  # the least urgent, its newest
            self._preempt(victim)
            if victim is req:
                return False
        if needed > 0:
            req.pages += self.pages.allocate(needed)
        return True

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self.pages.release(req)
        req.num_computed = 0
        first_of_class = next((i for i, r in enumerate(self.waiting) if r.priority >= req.priority), len(self.waiting))
        self.waiting.insert(first_of_class, req)  # first of its class: it was running before any of them
        self.num_preemptions += 1
