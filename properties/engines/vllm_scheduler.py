"""vLLM 0.33.0's own ``Scheduler`` driven with no model: the engine side of the scheduler level.

The manager-level adapter (:mod:`properties.engines.vllm`) drives vLLM's
``KVCacheManager`` while kvconform plays the scheduler, so vLLM's scheduler code that
decides what to pass to the manager (``vllm/v1/core/sched/scheduler.py``) never runs.
:class:`VLLMSchedulerHarness` runs that code: it builds vLLM's ``Scheduler`` for a
kvconform layout, adds a trace's requests, calls ``schedule()``, feeds a synthetic
``ModelRunnerOutput`` to ``update_from_output`` and reads back what the scheduler decided
(:class:`properties.core.decisions.StepDecisions`) and the state of its cache manager.
:mod:`properties.runner.decided` replays the decisions on the reference and compares.

How it is built (no model, no GPU, nothing downloaded)
------------------------------------------------------
* ``KVCacheConfig`` from the layout exactly as the manager-level adapter builds it
  (:func:`properties.engines.vllm.to_vllm_spec`); ``CacheConfig(block_size =
  layout.scheduler_block_size, enable_prefix_caching, mamba_cache_mode="align")`` with
  ``num_gpu_blocks = layout.num_blocks``.
* ``SchedulerConfig(max_num_batched_tokens = max_model_len, chunked prefill, FCFS,
  async_scheduling=False, scheduler_reserve_full_isl = admission_gate)``; the step's
  ``token_budget`` is set on ``scheduler.max_num_scheduled_tokens`` before each
  ``schedule()``. So vLLM's ``max_in_flight_tokens`` is ``max_model_len``, the
  reference's default.
* Draft tokens: ``SpeculativeConfig(method="ngram", num_speculative_tokens=k)`` (a
  drafter with no model of its own: no lookahead slots). After every step the harness
  proposes, as the drafter would, the request's next ``k`` trace outputs
  (``update_draft_token_ids``), bounded by its remaining outputs and ``max_model_len``.
* ``VllmConfig(scheduler_config, cache_config, speculative_config, device_config=cpu)``
  with no model; the scheduler reads seven fields of ``model_config`` and vLLM's
  ``StructuredOutputManager`` one more, which a frozen :class:`ModelStub` provides (a
  decoder-only text model, ``max_model_len`` of the layout, no tokenizer: no grammar is
  ever used).
* Requests: vLLM ``Request`` objects with ``SamplingParams(max_tokens = len(output)
  or 1, ignore_eos=True)`` hashed like the manager-level adapter's.

The model runner's output
-------------------------
For each scheduled request whose tokens reach its end, the sampled tokens are the
trace's next output token, plus, after a decode with ``d`` drafts, the ``a`` accepted
ones (``accepted(request_id, start, d)``, the caller's function, at most the outputs
left; 0 for the ``-1`` drafts vLLM pads a new 1-token request with); ``a`` goes into
the step's decisions. A request with no output samples one token (vLLM samples after every prefill)
and finishes, as kvconform's scheduler finishes it after its prefill.

Trace operations: ``Arrive`` -> ``add_request``; ``Step`` -> ``schedule`` +
``update_from_output``; ``Abort`` -> ``finish_requests(id, FINISHED_ABORTED)``;
``Preempt`` -> vLLM's own ``_preempt_request`` on a running request (the path
``reset_prefix_cache`` takes); ``ResetPrefixCache`` -> ``reset_prefix_cache()``.

Asynchronous scheduling (``asynchronous=True``): vLLM's ``AsyncScheduler``; each step
schedules step N, then processes step N - 1's output (as vLLM's engine core does); an
``Abort`` and a ``Preempt`` are vLLM's, at once also with tokens in flight (blocks freed;
a preempted request's in-flight output arrives stale and it is not resumed before).

KV connector (``lookup`` given: the ``external_hits`` modes, drafts or not; under
asynchronous scheduling vLLM defers a consumer connector's frees):
``KVTransferConfig`` names the stub :class:`properties.engines.vllm_connector.
KVConformConnector` (``kv_both``, ``recompute`` load-failure policy), which answers
``get_num_new_matched_tokens`` from ``lookup(request_id, token_ids, computed)`` (the
store's tokens beyond the computed prefix), asynchronously with ``async_loads``. The
worker's half: every asynchronous load started in a step is reported done in that
step's output (``KVConnectorOutput.finished_recving``), and failed too
(``failed_recving``) when ``load_fails(request_id, attempt)`` says so
(:func:`properties.core.modes.load_fails`, the reference's rule, with
``load_failures``). A step's decisions then carry its admission phase's connector
events in order (:class:`properties.core.decisions.ConnectorEvent`): the loads vLLM
completes (``_update_waiting_for_remote_kv``) and every allocation's
``update_state_after_alloc`` (block ids, external tokens); the block ids told at a
request's end (``request_finished_all_groups``) are kept in :attr:`told_at_end`.

Scheduler options (:class:`properties.core.scheduler_options.SchedulerOptions`):
priority policy (per-request priorities from the id, arrival times in order), a LoRA
limit, pause states set before each step, the long-prefill threshold and prefill
cadence, image inputs (``mm_features`` from the prompt's image placeholders and an
image model for the encoder budget: :mod:`properties.engines.vllm_images`), an
encoder-cache connector, a KV connector that saves (delayed frees), block-level load
failures and the ``fail`` policy, grammars (:mod:`properties.engines.vllm_grammar`),
the finished-ids report, the V1 model runner, stats off, a reset that preempts running
requests, dynamic drafts and observability metrics. Each step's decisions also carry
vLLM's preemptions in order (recorded as they happen), the running requests whose
allocation failed with no victim taken, and the requests a grammar ended; the view
carries the request accounting (:class:`properties.core.decisions.Accounting`).

Not driven (``docs/scheduler-level.md``): layouts with production settings (retention,
EAGLE, lookahead hashes), drafts with a Mamba group or with asynchronous scheduling,
streaming input sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from properties.core.decisions import (
    ALLOCATED,
    PROMOTE,
    Accounting,
    ConnectorEvent,
    ScheduledDecision,
    StepDecisions,
)
from properties.core.engine import EngineError
from properties.core.modes import load_fails
from properties.core.scheduler_options import (
    DEFAULT_OPTIONS,
    GrammarPlan,
    SchedulerOptions,
    connector_saves,
    grammar_plan,
    invalid_load_block,
    pause_state,
    request_priority,
)
from properties.core.trace import Arrive
from properties.engines.vllm import _call, _import_vllm, to_vllm_spec
from properties.engines.vllm_images import ImageRegistry, MultiModalConfigStub, mm_features
from reference.layout import KVCacheLayout

#: ``accepted(request_id, start, num_drafts)``: how many drafts a step accepts.
AcceptFn = Callable[[str, int, int], int]
#: ``lookup(request_id, token_ids, num_computed_tokens)``: a KV connector's store, the
#: tokens it holds beyond the computed prefix.
LookupFn = Callable[[str, tuple[int, ...], int], int]
#: the module and class vLLM loads as the KV connector (``kv_connector_module_path``)
CONNECTOR_MODULE = "properties.engines.vllm_connector"
CONNECTOR_CLASS = "KVConformConnector"

#: the module and class vLLM loads as the encoder-cache connector (``remote_images``)
EC_CONNECTOR_MODULE = "properties.engines.vllm_ec_connector"
EC_CONNECTOR_CLASS = "KVConformECConnector"

#: The scheduler modules the level measures (``--engine-coverage``).
COVERAGE_MODULES = ("vllm.v1.core.sched.scheduler",)


@dataclass(frozen=True)
class ModelStub:
    """The ``model_config`` fields vLLM's scheduler and structured-output manager read,
    for a decoder-only text model with no multimodal inputs (there is no model)."""

    max_model_len: int
    uses_mrope: bool = False
    is_encoder_decoder: bool = False
    runner_type: str = "generate"
    is_diffusion: bool = False
    supports_multimodal_inputs: bool = False
    return_sampling_mask: bool = False
    #: read by vLLM's ``StructuredOutputManager``: no tokenizer (no grammar is used)
    skip_tokenizer_init: bool = True
    #: read by ``VllmConfig.is_mm_encoder_only`` and vLLM's multimodal budget: None for a
    #: text model (:class:`properties.engines.vllm_images.MultiModalConfigStub` for images)
    multimodal_config: Any = None

    def get_multimodal_config(self) -> Any:
        return self.multimodal_config


@dataclass(frozen=True)
class ManagerView:
    """What the level compares after a step: per live request its block ids per group and
    computed tokens, and the free block count."""

    block_ids: dict[str, tuple[tuple[int, ...], ...]]
    num_computed_tokens: dict[str, int]
    num_free_blocks: int
    #: the scheduler's request accounting (``get_request_counts``, ...)
    accounting: Accounting | None = None


@dataclass(frozen=True)
class WorkerJobs:
    """What the worker's KV connector does in a step, reported with its output: the
    asynchronous loads the step started, the saves started before it, and the
    synchronous loads of its admissions as (request id, first, end) positions."""

    loads: tuple[str, ...] = ()
    saves: tuple[str, ...] = ()
    synchronous: tuple[tuple[str, int, int], ...] = ()

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.synchronous)


@contextmanager
def _model_runner(v2: bool) -> Iterator[None]:
    """vLLM's choice of model runner while its scheduler is built (it reads
    ``use_v2_model_runner`` once, from ``VLLM_USE_V2_MODEL_RUNNER``), restored after."""
    import os

    name = "VLLM_USE_V2_MODEL_RUNNER"
    before = os.environ.get(name)
    os.environ[name] = "1" if v2 else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _no_drafts(request_id: str, start: int, num_drafts: int) -> int:
    return 0


class VLLMSchedulerHarness:
    """vLLM's ``Scheduler`` (or ``scheduler_class``, a subclass: the mutants) for
    ``layout``; see the module docstring.

    Example: ``h = VLLMSchedulerHarness(layout); h.arrive(op); d = h.step(64)`` gives
    ``d.scheduled == (ScheduledDecision("r0", 0, 8),)`` for an 8-token prompt, no hit.
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        num_draft_tokens: int = 0,
        admission_gate: bool = False,
        scheduler_class: type | None = None,
        accepted: AcceptFn = _no_drafts,
        asynchronous: bool = False,
        lookup: LookupFn | None = None,
        async_loads: bool = False,
        load_failures: bool = False,
        options: SchedulerOptions = DEFAULT_OPTIONS,
    ) -> None:
        v = _import_vllm()
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            LoRAConfig,
            ObservabilityConfig,
            SchedulerConfig,
            SpeculativeConfig,
            VllmConfig,
        )
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
        from vllm.v1.structured_output import StructuredOutputManager

        self.layout = layout
        self.options = options
        self._v = v
        if options.structured_output or options.invalid_blocks or options.fail_on_load_errors:
            # the failures these options drive are logged as errors by vLLM's scheduler
            # ("grammar rejected tokens", "Failing N request(s)"): expected here
            import logging

            logging.getLogger("vllm.v1.core.sched.scheduler").setLevel(logging.CRITICAL)
        #: arrivals so far: a request's arrival time (ties of equal priority go by it)
        self._num_arrivals = 0
        #: steps so far: the index of :func:`pause_state`
        self._num_steps = 0
        self._accepted = accepted
        self._outputs: dict[str, tuple[int, ...]] = {}
        self._num_draft_tokens = num_draft_tokens
        #: preempted by a trace operation since the last step (vLLM reports them with
        #: the next step's preemptions; they are not the step's decisions)
        self._external_preemptions: set[str] = set()
        self._mro = ModelRunnerOutput
        self._draft_ids = DraftTokenIds
        length = layout.max_model_len
        scheduler_config = SchedulerConfig(
            max_num_seqs=min(options.max_num_seqs, length),
            max_num_batched_tokens=length,
            max_model_len=length,
            enable_chunked_prefill=options.chunked_prefill,
            is_encoder_decoder=False,
            async_scheduling=asynchronous,
            scheduler_reserve_full_isl=admission_gate,
            policy=options.policy,
            long_prefill_token_threshold=min(options.long_prefill_token_threshold, length),
            long_prefill_token_threshold_adaptive=options.adaptive_long_prefill,
            prefill_schedule_interval=options.prefill_schedule_interval,
        )
        cache_config = CacheConfig(
            block_size=layout.scheduler_block_size,
            enable_prefix_caching=layout.enable_caching,
            mamba_cache_mode="align",
        )
        cache_config.num_gpu_blocks = layout.num_blocks
        # dynamic drafts: all of them for a batch of one request, one for larger ones
        schedule = (
            [(1, 1, num_draft_tokens), (2, 64, 1)]
            if options.dynamic_drafts and num_draft_tokens
            else None
        )
        speculative = (
            SpeculativeConfig(
                method="ngram",
                num_speculative_tokens=num_draft_tokens,
                prompt_lookup_max=1,
                prompt_lookup_min=1,
                num_speculative_tokens_per_batch_size=schedule,
            )
            if num_draft_tokens
            else None
        )
        if (options.invalid_blocks or options.fail_on_load_errors) and asynchronous:
            raise EngineError(
                "vllm scheduler: block-level load failures and the fail policy are driven "
                "with synchronous scheduling only (docs/scheduler-level.md)"
            )
        transfer = (
            None
            if lookup is None
            else KVTransferConfig(
                kv_connector=CONNECTOR_CLASS,
                kv_connector_module_path=CONNECTOR_MODULE,
                kv_role="kv_both",
                kv_load_failure_policy="fail" if options.fail_on_load_errors else "recompute",
            )
        )
        encoder_transfer = None
        if options.remote_images:
            from vllm.config import ECTransferConfig

            encoder_transfer = ECTransferConfig(
                ec_connector=EC_CONNECTOR_CLASS,
                ec_connector_module_path=EC_CONNECTOR_MODULE,
                ec_role="ec_consumer",
            )
        observability = ObservabilityConfig(
            kv_cache_metrics=options.metrics,
            kv_cache_metrics_sample=1.0,
            per_request_spec_decode_metrics="detailed" if options.metrics else "none",
        )
        config = VllmConfig(
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            speculative_config=speculative,
            device_config=DeviceConfig(device="cpu"),
            kv_transfer_config=transfer,
            ec_transfer_config=encoder_transfer,
            observability_config=observability,
        )
        # no model: the scheduler reads only ModelStub's fields of model_config
        images = options.encoder_budget > 0
        model = ModelStub(
            max_model_len=length,
            supports_multimodal_inputs=images,
            multimodal_config=MultiModalConfigStub() if images else None,
        )
        object.__setattr__(config, "model_config", model)
        if images:  # the encoder budget and cache (init=False fields of SchedulerConfig)
            scheduler_config.max_num_encoder_input_tokens = options.encoder_budget
            scheduler_config.encoder_cache_size = options.encoder_budget
            scheduler_config.disable_chunked_mm_input = options.unchunked_images
        if options.max_loras:  # set after: VllmConfig checks a LoRA config against the model
            object.__setattr__(config, "lora_config", LoRAConfig(max_loras=options.max_loras))
        groups = [
            v.kvi.KVCacheGroupSpec(
                list(g.layer_names), to_vllm_spec(v, g.spec), is_eagle_group=g.is_eagle_group
            )
            for g in layout.groups
        ]
        kv_cache_config = v.kvi.KVCacheConfig(
            num_blocks=layout.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        cls = scheduler_class or (AsyncScheduler if asynchronous else Scheduler)
        self.asynchronous = asynchronous
        #: asynchronous scheduling: the step scheduled and not processed yet (its
        #: SchedulerOutput, order, the requests that sample and the worker's jobs)
        self._in_flight: tuple[Any, list[str], set[str], WorkerJobs] | None = None
        #: asynchronous loads not reported yet: request id -> (first, end) positions
        self._load_ranges: dict[str, tuple[int, int]] = {}
        #: vLLM's bound on unprocessed tokens (max_concurrent_batches * budget cap)
        self.max_in_flight_tokens = int(config.max_in_flight_tokens)
        # the engine core passes no hash block size when blocks are hashed whole
        hashed = layout.hash_block_size
        with _model_runner(v2=not options.v1_model_runner):
            self.scheduler = _call(
                "Scheduler",
                (layout.describe(),),
                cls,
                config,
                kv_cache_config,
                StructuredOutputManager(config),
                block_size=layout.scheduler_block_size,
                hash_block_size=None if hashed == layout.scheduler_block_size else hashed,
                mm_registry=ImageRegistry(),
                include_finished_set=options.report_finished,
                log_stats=options.stats,
            )
        self._hasher = (
            v.get_request_block_hasher(layout.hash_block_size, v.sha256, 0)
            if layout.enable_caching
            else None
        )
        #: the KV connector stub (None without ``lookup``)
        self.connector = self.scheduler.connector
        self._load_failures = load_failures
        #: loads started per request (``load_fails``' attempt)
        self._load_attempts: dict[str, int] = {}
        #: block ids told at each request's end (``request_finished_all_groups``), not
        #: read yet: request id -> block ids
        self.told_at_end: dict[str, tuple[tuple[int, ...], ...]] = {}
        #: the admission phase's connector events of the step being scheduled
        self._events: list[ConnectorEvent] = []
        #: how often vLLM reset its connector's store (``reset_cache``)
        self.connector_resets = 0
        #: the scheduler's own preemptions during the step being scheduled, in order
        self._preempted: list[str] = []
        preempt = self.scheduler._preempt_request
        self._preempt_request = preempt

        def preempted(request: Any, *args: Any, **kwargs: Any) -> None:  # observed only
            self._preempted.append(request.request_id)
            preempt(request, *args, **kwargs)

        self.scheduler._preempt_request = preempted
        #: running requests whose allocation failed during the step being scheduled
        self._failed_running: list[str] = []
        manager = self.scheduler.kv_cache_manager
        allocate = manager.allocate_slots
        running = v.RequestStatus.RUNNING

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:  # observed only
            new = allocate(request, *args, **kwargs)
            if new is None and request.status == running:
                self._failed_running.append(request.request_id)
            return new

        manager.allocate_slots = allocate_slots
        #: structured output: grammars compiling (request id -> future, plan, due step)
        #: and the requests a grammar ended with an error since the last step
        self._compiling: dict[str, tuple[Any, GrammarPlan, int]] = {}
        self._grammar_errors: list[str] = []
        #: the finished ids vLLM reported with the output processed in this step
        self._finished_reported: tuple[str, ...] | None = None
        if options.structured_output:
            from properties.engines.vllm_grammar import GrammarBackend

            self.scheduler.structured_output_manager.backend = GrammarBackend()
            free_request = self.scheduler._free_request
            error = v.RequestStatus.FINISHED_ERROR

            def free_observed(request: Any, *args: Any, **kwargs: Any) -> Any:  # observed
                if request.status == error and request.use_structured_output:
                    self._grammar_errors.append(request.request_id)
                return free_request(request, *args, **kwargs)

            self.scheduler._free_request = free_observed
        if self.connector is not None:
            self.connector.lookup = lookup
            self.connector.asynchronous = async_loads
            if options.delayed_frees:
                self.connector.saves = connector_saves
            self.connector.reset = self._connector_reset
            promote = self.scheduler._update_waiting_for_remote_kv

            def promoted(request: Any) -> None:  # observed, not changed
                self._events.append(ConnectorEvent(PROMOTE, request.request_id))
                promote(request)

            self.scheduler._update_waiting_for_remote_kv = promoted

    # -- trace operations ------------------------------------------------------
    def arrive(self, op: Arrive) -> None:
        v = self._v
        plan = grammar_plan(op.request_id) if self.options.structured_output else None
        grammar = None
        if plan is not None:
            from vllm.sampling_params import StructuredOutputsParams

            grammar = StructuredOutputsParams(regex=".*")
        params = v.SamplingParams(
            max_tokens=max(1, len(op.output)), ignore_eos=True, structured_outputs=grammar
        )
        lora = (
            None
            if op.lora_name is None
            else v.LoRARequest(op.lora_name, 1 + sum(map(ord, op.lora_name)), "/kvconform/lora")
        )
        priority = request_priority(op.request_id) if self.options.policy == "priority" else 0
        self._num_arrivals += 1
        request = _call(
            "Request",
            (op.request_id,),
            v.Request,
            op.request_id,
            list(op.prompt),
            params,
            None,
            arrival_time=float(self._num_arrivals),
            mm_features=mm_features(op.prompt) if self.options.encoder_budget else None,
            lora_request=lora,
            cache_salt=op.cache_salt,
            priority=priority,
            block_hasher=self._hasher,
        )
        self._outputs[op.request_id] = tuple(op.output)
        if plan is not None:  # the engine core's grammar_init: compiling from now on
            from concurrent.futures import Future

            request.status = v.RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            future: Future = Future()
            request.structured_output_request.grammar = future
            self._compiling[op.request_id] = (future, plan, self._num_steps + plan.compile_steps)
        _call("add_request", (op.request_id,), self.scheduler.add_request, request)

    def _compile_grammars(self) -> None:
        """Grammars due by the step about to be scheduled finish compiling (a plan's
        ``compile_steps`` steps after their request arrived), or fail to."""
        from properties.engines.vllm_grammar import PlannedGrammar

        for rid, (future, plan, due) in list(self._compiling.items()):
            if due < self._num_steps:
                del self._compiling[rid]
                if plan.compile_fails:
                    future.set_exception(ValueError(f"{rid}: the grammar does not compile"))
                else:
                    future.set_result(PlannedGrammar(plan))

    def abort(self, request_id: str) -> None:
        """``finish_requests(id, FINISHED_ABORTED)`` (at once, also with tokens in
        flight)."""
        status = self._v.RequestStatus.FINISHED_ABORTED
        _call("finish_requests", (request_id,), self.scheduler.finish_requests, request_id, status)
        self._read_told()

    def preempt(self, request_id: str) -> None:
        """vLLM's own preemption of a running request (``_preempt_request``, the path its
        ``reset_prefix_cache`` and allocation failures take, also with tokens in
        flight); no-op otherwise."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request not in self.scheduler.running:
            return
        self.scheduler.running.remove(request)
        self._external_preemptions.add(request_id)
        _call("_preempt_request", (request_id,), self._preempt_request, request, 0.0)

    def _connector_reset(self) -> None:
        """The connector's ``reset_cache``: counted (the reference empties the store it
        shares with vLLM's connector, and checks the count)."""
        self.connector_resets += 1

    def reset_prefix_cache(self) -> bool:
        """``reset_prefix_cache()`` (with ``reset_connector`` under that option)."""
        reset = self.scheduler.reset_prefix_cache
        connector = self.options.reset_connector and self.connector is not None
        running = self.options.reset_running
        if running:  # preempted outside a step: reported with the next one
            self._external_preemptions.update(r.request_id for r in self.scheduler.running)
        return bool(
            _call(
                "reset_prefix_cache",
                (),
                reset,
                reset_running_requests=running,
                reset_connector=connector,
            )
        )

    def step(self, token_budget: int) -> StepDecisions:
        """``schedule()`` with ``token_budget``, the synthetic output, ``update_from_output``
        and the drafter's proposals; returns what the scheduler decided."""
        s = self.scheduler
        s.max_num_scheduled_tokens = token_budget
        self._num_steps += 1
        if self.options.pauses:
            from vllm.v1.core.sched.interface import PauseState

            s.set_pause_state(PauseState[pause_state(self._num_steps)])
        before = {rid: r.num_computed_tokens for rid, r in s.requests.items()}
        proposed = tuple((r.request_id, len(r.spec_token_ids)) for r in s.running)
        self._events = []
        self._preempted = []
        self._failed_running = []
        self._compile_grammars()
        out = _call("schedule", (token_budget,), s.schedule)
        if out.has_structured_output_requests:  # the engine core's grammar bitmask
            _call("get_grammar_bitmask", (token_budget,), s.get_grammar_bitmask, out)
        events = self._connector_events()
        order = [r.request_id for r in s.running if r.request_id in out.num_scheduled_tokens]
        missing = set(out.num_scheduled_tokens) - set(order)
        if missing:
            raise EngineError(f"vllm scheduler: scheduled {sorted(missing)} but not running")
        spec = out.scheduled_spec_decode_tokens
        new = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        resumed = set(cached.resumed_req_ids)
        decisions = []
        for rid in order:
            start = new.get(rid)
            if start is None:
                i = cached.req_ids.index(rid)
                start = cached.num_computed_tokens[i] if rid in resumed else before[rid]
            drafts = spec.get(rid, ())
            accepted = self._num_accepted(rid, start, drafts)
            n = out.num_scheduled_tokens[rid]
            decisions.append(ScheduledDecision(rid, start, n, len(drafts), accepted))
        # victims in the order vLLM preempted them (FCFS: the running list's tail first;
        # priority: the lowest priority, latest arrival first)
        reported = set(out.preempted_req_ids or ())
        preempted = tuple(self._preempted)
        if not set(preempted) <= reported <= set(preempted) | self._external_preemptions:
            raise EngineError(
                f"vllm scheduler: preempted {preempted} in schedule(), reported {sorted(reported)}"
            )
        self._external_preemptions.clear()
        if self.asynchronous:
            # schedule N, then process N - 1 (as vLLM's engine core does); the requests
            # whose chunk reaches the last known or pending token sample
            samples = {rid for rid in order if not s.requests[rid].is_prefill_chunk}
            work = self._take_worker_jobs(events, decisions)
            previous, self._in_flight = self._in_flight, (out, order, samples, work)
            if previous is not None:
                self._process(*previous)
        else:
            work = self._take_worker_jobs(events, decisions)
            sampled = [self._sampled(d) for d in decisions]
            output = self._mro(
                req_ids=order,
                req_id_to_index={rid: i for i, rid in enumerate(order)},
                sampled_token_ids=sampled,
                kv_connector_output=self._worker_output(work),
                ec_connector_output=self._encoder_worker_output(),
            )
            outputs = _call(
                "update_from_output", (token_budget,), s.update_from_output, out, output
            )
            self._report_finished(outputs)
            self._saved(work)
            self._read_told()
            self._propose_drafts(out)
        done = {d.request_id for d in decisions} | set(preempted)
        failed = tuple(dict.fromkeys(r for r in self._failed_running if r not in done))
        errors, self._grammar_errors = tuple(self._grammar_errors), []
        reported, self._finished_reported = self._finished_reported, None
        return StepDecisions(
            tuple(decisions), preempted, proposed, events, failed, errors, reported
        )

    def _report_finished(self, outputs: Any) -> None:
        """``report_finished``: the ids vLLM's engine core outputs carry as finished (the
        ``include_finished_set`` report of one output processing)."""
        if not self.options.report_finished:
            return
        ids: set[str] = set()
        for out in (outputs or {}).values():
            ids |= set(out.finished_requests or ())
        self._finished_reported = tuple(sorted(ids))

    # -- the KV connector ----------------------------------------------------------
    def _connector_events(self) -> tuple[ConnectorEvent, ...]:
        """The step's admission-phase events: the loads completed (observed as they
        happen) merged with the stub's ``update_state_after_alloc`` calls; every
        completion precedes the allocation of the request it completes, so both
        lists in call order give the interleaving."""
        if self.connector is None:
            return ()
        promoted = list(self._events)
        events: list[ConnectorEvent] = []
        for told in self._read_told():
            while promoted and promoted[0].request_id != told.request_id:
                events.append(promoted.pop(0))
            if promoted:
                events.append(promoted.pop(0))
            request = self.scheduler.requests[told.request_id]
            waits = request.status == self._v.RequestStatus.WAITING_FOR_REMOTE_KVS
            external = int(told.num_external_tokens or 0)
            events.append(
                ConnectorEvent(ALLOCATED, told.request_id, external, waits, told.block_ids)
            )
        return tuple(events + promoted)

    def _read_told(self) -> list[Any]:
        """The stub's records since the last call: ends go to :attr:`told_at_end`, the
        admissions are returned."""
        if self.connector is None:
            return []
        admissions = []
        for told in self.connector.take_told():
            if told.num_external_tokens is None:
                self.told_at_end[told.request_id] = told.block_ids
            else:
                admissions.append(told)
        return admissions

    def _take_worker_jobs(
        self, events: Sequence[ConnectorEvent], decisions: Sequence[ScheduledDecision]
    ) -> WorkerJobs:
        """The worker's jobs of the step just scheduled: the asynchronous loads it
        started, its synchronous loads (from the admissions' events) and the saves
        started before it; all are reported with its output."""
        if self.connector is None:
            return WorkerJobs()
        starts = {d.request_id: d.start for d in decisions}
        synchronous = []
        for e in events:
            if e.kind == ALLOCATED and e.external_tokens and not e.asynchronous:
                end = starts[e.request_id]
                synchronous.append((e.request_id, end - e.external_tokens, end))
            elif e.kind == ALLOCATED and e.external_tokens:
                end = self.scheduler.requests[e.request_id].num_computed_tokens
                self._load_ranges[e.request_id] = (end - e.external_tokens, end)
        return WorkerJobs(
            tuple(self.connector.take_loads()),
            tuple(self.connector.take_saves()),
            tuple(synchronous),
        )

    def _saved(self, work: WorkerJobs) -> None:
        if self.connector is not None:
            self.connector.saved(list(work.loads), list(work.saves))

    def _worker_output(self, work: WorkerJobs) -> Any:
        """The worker's connector output for a step (:meth:`_take_worker_jobs`): its
        asynchronous loads are done, and failed wholly where ``load_fails`` says so; with
        ``invalid_blocks``, a block of a load (asynchronous or not) the worker could not
        write where ``invalid_load_block`` says so; its saves are done."""
        if self.connector is None:
            return None
        from vllm.v1.outputs import KVConnectorOutput

        if work.is_empty():
            return None
        failed, invalid = set(), set()
        loads = [(rid, *self._load_ranges.pop(rid, (0, 0))) for rid in work.loads]
        for rid, start, end in [*loads, *work.synchronous]:
            attempt = self._load_attempts.get(rid, 0)
            self._load_attempts[rid] = attempt + 1
            if rid in work.loads and self._load_failures and load_fails(rid, attempt):
                failed.add(rid)
                continue
            block = self._invalid_block(rid, attempt, start, end)
            if block is not None:
                invalid.add(block)
        return KVConnectorOutput(
            finished_recving=set(work.loads),
            failed_recving=failed,
            finished_sending=set(work.saves),
            invalid_block_ids=invalid,
        )

    def _encoder_worker_output(self) -> Any:
        """The encoder-cache connector's worker output of a step (``remote_images``): no
        transfer to report (the stub's transfers complete at the scheduler's check)."""
        if not self.options.remote_images:
            return None
        from vllm.v1.outputs import ECConnectorOutput

        return ECConnectorOutput()

    def _invalid_block(self, request_id: str, attempt: int, start: int, end: int) -> int | None:
        """The block id the worker reports invalid for the load of positions ``[start,
        end)`` (``invalid_blocks``, one group): the ``invalid_load_block``-th block of
        the load's range, if the load wrote it (not past its end, not a null entry)."""
        if not self.options.invalid_blocks or len(self.layout.groups) != 1:
            return None
        k = invalid_load_block(request_id, attempt)
        bs = self.layout.groups[0].spec.block_size
        if k is None or start // bs + k >= end // bs:
            return None
        request = self.scheduler.requests.get(request_id)
        if request is None or request.is_finished():
            return None
        table = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
        block = int(table[start // bs + k])
        return block or None  # a null entry (a window's skipped block) was not written

    def _process(self, out: Any, order: list[str], samples: set[str], work: WorkerJobs) -> None:
        """Asynchronous scheduling: the output of a step scheduled earlier; a request that
        samples gets its next trace output (outputs are processed in order); the worker
        reports the loads the step started."""
        sampled = []
        for rid in order:
            request = self.scheduler.requests.get(rid)
            if rid not in samples or request is None:
                sampled.append([])
                continue
            outputs = self._outputs[rid]
            sampled.append(
                list(outputs[request.num_output_tokens : request.num_output_tokens + 1]) or [0]
            )
        output = self._mro(
            req_ids=order,
            req_id_to_index={rid: i for i, rid in enumerate(order)},
            sampled_token_ids=sampled,
            kv_connector_output=self._worker_output(work),
            ec_connector_output=self._encoder_worker_output(),
        )
        s = self.scheduler
        outputs = _call("update_from_output", ("async",), s.update_from_output, out, output)
        self._report_finished(outputs)
        self._saved(work)
        self._read_told()

    def _sampled(self, d: ScheduledDecision) -> list[int]:
        """The tokens the model samples for ``d``: none mid-prefill; else the next output
        (``0`` for a request with no output) and the accepted drafts."""
        request = self.scheduler.requests[d.request_id]
        end = d.start + d.num_tokens - d.num_drafts
        if end < request.num_tokens:
            return []
        outputs = self._outputs[d.request_id]
        g = request.num_output_tokens
        return list(outputs[g : g + 1 + d.num_accepted]) or [0]

    def _num_accepted(self, request_id: str, start: int, drafts: Sequence[int]) -> int:
        """Drafts the model accepts: ``accepted(...)``, at most the outputs left after the
        next one; none of vLLM's padding drafts (``-1``: a 1-token request padded to the
        step's draft size)."""
        if not drafts or any(t < 0 for t in drafts):
            return 0
        request = self.scheduler.requests[request_id]
        left = len(self._outputs[request_id]) - request.num_output_tokens - 1
        return max(0, min(self._accepted(request_id, start, len(drafts)), left))

    def _propose_drafts(self, out: Any) -> None:
        """The drafter: every running decoding request proposes its next ``k`` outputs
        (``k`` as many as the step's output asks for: dynamic drafts)."""
        k = min(self._num_draft_tokens, int(out.num_spec_tokens_to_schedule or 0))
        if not self._num_draft_tokens:
            return
        ids, drafts = [], []
        for request in self.scheduler.running:
            if request.num_computed_tokens < request.num_tokens - 1:
                continue
            outputs = self._outputs[request.request_id]
            g = request.num_output_tokens
            room = min(len(outputs) - g - 1, self.layout.max_model_len - request.num_tokens)
            proposal = list(outputs[g + 1 : g + 1 + min(k, max(0, room))])
            ids.append(request.request_id)
            drafts.append(proposal)
        if ids:
            _call(
                "update_draft_token_ids",
                (ids,),
                self.scheduler.update_draft_token_ids,
                self._draft_ids(ids, drafts),
            )

    # -- state -------------------------------------------------------------------
    def view(self) -> ManagerView:
        """The cache manager's state: what :mod:`properties.runner.decided` compares."""
        manager = self.scheduler.kv_cache_manager
        blocks, computed = {}, {}
        for rid, request in self.scheduler.requests.items():
            if request.is_finished():
                continue
            ids = _call("get_block_ids", (rid,), manager.get_block_ids, rid)
            blocks[rid] = tuple(tuple(group) for group in ids)
            computed[rid] = request.num_computed_tokens
        free = int(manager.block_pool.get_num_free_blocks())
        return ManagerView(blocks, computed, free, self.accounting())

    def accounting(self) -> Accounting:
        """What vLLM's engine core reads between steps (``get_request_counts``,
        ``has_finished_requests``); ``get_num_unfinished_requests`` is checked against
        them under the pause state (running and waiting; only the block holders waiting
        when ``PAUSED_NEW``; nothing when ``PAUSED_ALL``)."""
        from vllm.v1.core.sched.interface import PauseState

        s = self.scheduler
        running, waiting = s.get_request_counts()
        holding = len(s.kv_holding_waiting)
        state = s.pause_state
        want = {
            PauseState.UNPAUSED: running + waiting,
            PauseState.PAUSED_NEW: running + holding,
            PauseState.PAUSED_ALL: 0,
        }[state]
        got = s.get_num_unfinished_requests()
        if got != want or s.has_requests() != (got > 0 or s.has_finished_requests()):
            raise EngineError(
                f"vllm scheduler: get_num_unfinished_requests() is {got} under {state.name} "
                f"with {running} running, {waiting} waiting ({holding} holding blocks)"
            )
        return Accounting(running, waiting, bool(s.has_finished_requests()))

    def close(self) -> None:
        """The end of a trace: vLLM's ``shutdown`` (its connector and event publisher)."""
        _call("shutdown", (), self.scheduler.shutdown)


def make_harness(layout: KVCacheLayout, **kwargs: Any) -> VLLMSchedulerHarness:
    """Build a :class:`VLLMSchedulerHarness` (vLLM is imported here)."""
    return VLLMSchedulerHarness(layout, **kwargs)


__all__ = [
    "COVERAGE_MODULES",
    "LookupFn",
    "ManagerView",
    "ModelStub",
    "VLLMSchedulerHarness",
    "make_harness",
]
