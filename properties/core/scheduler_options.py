"""How the scheduler level configures an engine's own scheduler beyond the serving mode.

The serving mode (:class:`properties.core.modes.ServingMode`) says what every engine and
kvconform's own scheduler model (asynchronous scheduling, drafts, the admission gate, a
KV connector). The scheduler level (``kvconform check --engine vllm-scheduler``,
``docs/scheduler-level.md``) also runs vLLM's scheduler in configurations whose
*decisions* differ (which request runs, with how many tokens, which is preempted) while
the reference replays those decisions: :class:`SchedulerOptions`.

Per-request inputs these options need and a trace does not carry are deterministic
functions of the request id (so that a trace replays): the priority
(:func:`request_priority`). The pause states are a fixed pattern of the step index
(:func:`pause_state`), as an operator would pause and resume.

Worked example: ``SchedulerOptions(policy="priority")`` builds vLLM's scheduler with
``SchedulingPolicy.PRIORITY`` and gives request ``"r3"`` priority
``request_priority("r3")`` (one of 0, 1, 2; lower runs first, ties by arrival).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from properties.core.images import MAX_IMAGE_LENGTH
from reference.errors import KVConformError

#: the scheduling policies of vLLM's ``SchedulerConfig.policy``
POLICIES: tuple[str, ...] = ("fcfs", "priority")
#: the pause states of vLLM's ``PauseState``, by name
UNPAUSED, PAUSED_NEW, PAUSED_ALL = "UNPAUSED", "PAUSED_NEW", "PAUSED_ALL"


@dataclass(frozen=True)
class SchedulerOptions:
    """The scheduler configuration of one scheduler-level example (module docstring).

    * ``policy``: ``"fcfs"`` or ``"priority"`` (:func:`request_priority`);
    * ``max_loras``: 0 without a LoRA configuration, else vLLM's ``LoRAConfig.max_loras``
      (a waiting request whose adapter would exceed it is skipped);
    * ``long_prefill_token_threshold`` (0: none) and ``adaptive_long_prefill``: vLLM's cap
      on one request's chunk while others wait;
    * ``prefill_schedule_interval``: vLLM's local prefill cadence (1: every step);
    * ``max_num_seqs``: the most running requests (capped by ``max_model_len``);
    * ``chunked_prefill``: False makes a prompt that does not fit the budget wait;
    * ``pauses``: the harness sets vLLM's pause state before each step
      (:func:`pause_state`);
    * ``encoder_budget`` (0: no encoder inputs): the model takes images
      (:mod:`properties.core.images`: the requests' image placeholders become vLLM's
      ``mm_features``) with this encoder compute budget and encoder cache size, in
      tokens (at least :data:`properties.core.images.MAX_IMAGE_LENGTH`);
      ``unchunked_images``: an image is never split across chunks
      (``disable_chunked_mm_input``);
    * ``delayed_frees`` (a KV connector): the connector saves the blocks of one ended
      request in two (:func:`connector_saves`) and keeps them until the worker reports
      the save done with the output of the next step scheduled
      (``request_finished`` returns True, then ``finished_sending``);
    * ``reset_connector`` (a KV connector): a ``ResetPrefixCache`` resets the
      connector's store too (``reset_prefix_cache(reset_connector=True)``: the host tier
      is emptied);
    * ``invalid_blocks`` (a KV connector, single-group layouts: vLLM refuses block-level
      failures with several groups): the worker reports loaded blocks it could not
      write (:func:`invalid_load_block`, ``invalid_block_ids``), synchronous and
      asynchronous loads alike;
    * ``fail_on_load_errors`` (a KV connector): vLLM's ``fail`` load-failure policy (a
      request whose load failed, wholly or in a block, ends with an error) instead of
      ``recompute``;
    * ``structured_output``: requests ask for a grammar (:func:`grammar_plan`): they wait
      until it compiles, a failed compilation ends them, and a grammar that rejects a
      sampled token ends the request (drafts it rejects are dropped before they run);
    * ``report_finished``: vLLM reports the requests that ended with each output
      (``include_finished_set``, as a data-parallel engine core asks), compared with the
      requests that ended on the reference;
    * ``v1_model_runner``: vLLM's scheduler as built for the V1 model runner
      (``VLLM_USE_V2_MODEL_RUNNER=0``: token ids resent for requests not scheduled in
      the previous step);
    * ``stats``: vLLM's ``log_stats`` (off: no scheduler stats, no event timestamps);
    * ``reset_running``: a ``ResetPrefixCache`` first preempts every running request,
      newest first, dropping their in-flight outputs (vLLM's
      ``reset_prefix_cache(reset_running_requests=True)``, as after a weight update);
    * ``remote_images`` (with ``encoder_budget``): an encoder-cache connector holds some
      images' encoder outputs, loaded instead of computed; a request waits one step
      for their transfer (:mod:`properties.engines.vllm_ec_connector`);
    * ``dynamic_drafts`` (with drafts): vLLM's dynamic speculative decoding, the number
      of drafts the drafter proposes after a step set by the step's batch size (one
      running request: all, more: one), and no padding of admissions;
    * ``metrics``: vLLM's observability options: the KV block metrics collector
      (every block sampled) and per-request speculative decoding metrics.
    """

    policy: str = "fcfs"
    max_loras: int = 0
    long_prefill_token_threshold: int = 0
    adaptive_long_prefill: bool = False
    prefill_schedule_interval: int = 1
    max_num_seqs: int = 64
    chunked_prefill: bool = True
    pauses: bool = False
    encoder_budget: int = 0
    unchunked_images: bool = False
    delayed_frees: bool = False
    reset_connector: bool = False
    invalid_blocks: bool = False
    fail_on_load_errors: bool = False
    structured_output: bool = False
    report_finished: bool = False
    v1_model_runner: bool = False
    stats: bool = True
    reset_running: bool = False
    remote_images: bool = False
    dynamic_drafts: bool = False
    metrics: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise KVConformError(
                f"SchedulerOptions.policy must be one of {POLICIES}, got {self.policy!r}"
            )
        for name in (
            "max_loras",
            "long_prefill_token_threshold",
            "prefill_schedule_interval",
            "max_num_seqs",
            "encoder_budget",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise KVConformError(
                    f"SchedulerOptions.{name} must be an integer >= 0, got {value!r}"
                )
        if self.prefill_schedule_interval < 1 or self.max_num_seqs < 1:
            raise KVConformError(
                "SchedulerOptions.prefill_schedule_interval and max_num_seqs must be >= 1"
            )
        if 0 < self.encoder_budget < MAX_IMAGE_LENGTH:
            raise KVConformError(
                f"SchedulerOptions.encoder_budget must be 0 or at least {MAX_IMAGE_LENGTH} "
                "(the longest image)"
            )
        for name in (
            "adaptive_long_prefill",
            "chunked_prefill",
            "pauses",
            "unchunked_images",
            "delayed_frees",
            "reset_connector",
            "invalid_blocks",
            "fail_on_load_errors",
            "structured_output",
            "report_finished",
            "v1_model_runner",
            "stats",
            "reset_running",
            "remote_images",
            "dynamic_drafts",
            "metrics",
        ):
            if not isinstance(getattr(self, name), bool):
                raise KVConformError(f"SchedulerOptions.{name} must be a boolean")

    def describe(self) -> str:
        """The options that differ from the defaults, e.g. ``policy=priority max_loras=1``
        (``default`` when none does)."""
        default = SchedulerOptions()
        parts = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return " ".join(parts) or "default"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: Any, where: str = "options") -> SchedulerOptions:
        """The options from :meth:`to_json`'s data (missing fields: defaults; an unknown
        field is a one-line error)."""
        if data is None:
            return SchedulerOptions()
        if not isinstance(data, Mapping):
            raise KVConformError(f"{where} must be an object, got {data!r}")
        known = {f.name for f in dataclasses.fields(SchedulerOptions)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise KVConformError(f"{where}: unknown fields {unknown}")
        return SchedulerOptions(**dict(data))


#: the defaults, for argument defaults
DEFAULT_OPTIONS = SchedulerOptions()


def _digest(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def request_priority(request_id: str) -> int:
    """The priority of ``request_id`` under ``policy="priority"``: 0, 1 or 2 from a
    ``sha256`` of the id (lower is served first). Example: every run gives ``"r0"`` the
    same priority."""
    return _digest(f"priority:{request_id}")[0] % 3


def connector_saves(request_id: str) -> bool:
    """Whether the KV connector saves ``request_id``'s blocks at its end (keeping them
    until the save is reported) under ``delayed_frees``: one request in two, from a
    ``sha256`` of the id."""
    return _digest(f"save:{request_id}")[0] % 2 == 0


def invalid_load_block(request_id: str, attempt: int) -> int | None:
    """Under ``invalid_blocks``: the first block the worker could not write in attempt
    ``attempt`` (0 first) of ``request_id``'s load, as an index among the blocks the
    load writes (past its last block: none fails), or None: for a first load one time
    in two (a ``sha256`` of the id), at index 0, 1 or 2; a retry never fails."""
    if attempt > 0:
        return None
    digest = _digest(f"invalid:{request_id}")
    return digest[1] % 3 if digest[0] % 2 == 0 else None


@dataclass(frozen=True)
class GrammarPlan:
    """A request's grammar under ``structured_output``: it compiles for
    ``compile_steps`` steps (0: ready when the first step is scheduled), or fails to;
    once compiled it rejects ``rejected_token`` (None: nothing) wherever it is sampled or
    drafted."""

    compile_steps: int
    compile_fails: bool
    rejected_token: int | None


def grammar_plan(request_id: str) -> GrammarPlan | None:
    """The grammar of ``request_id`` under ``structured_output``, from a ``sha256`` of the
    id: none for one request in two; otherwise compiling for 0-2 steps, failing one time
    in four, and rejecting one text token (0-7) two times in three. Example: every run
    gives ``"r0"`` the same plan."""
    digest = _digest(f"grammar:{request_id}")
    if digest[0] % 2:
        return None
    rejected = digest[3] % 8 if digest[2] % 3 else None
    return GrammarPlan(digest[1] % 3, digest[4] % 4 == 0, rejected)


def pause_state(step_index: int) -> str:
    """The pause state the harness sets before step ``step_index`` (1 first) under
    ``pauses``: a fixed pattern of period 7, steps 3 and 4 ``PAUSED_NEW`` (running
    requests and waiting ones that hold blocks go on, nothing new is admitted), step 6
    ``PAUSED_ALL`` (nothing is scheduled), the others ``UNPAUSED``. Example:
    ``pause_state(10) == PAUSED_NEW``."""
    phase = step_index % 7
    if phase in (3, 4):
        return PAUSED_NEW
    if phase == 6:
        return PAUSED_ALL
    return UNPAUSED


__all__ = [
    "DEFAULT_OPTIONS",
    "GrammarPlan",
    "PAUSED_ALL",
    "PAUSED_NEW",
    "POLICIES",
    "SchedulerOptions",
    "UNPAUSED",
    "connector_saves",
    "grammar_plan",
    "invalid_load_block",
    "pause_state",
    "request_priority",
]
