"""A KV connector stub for vLLM 0.33's scheduler: the scheduler level's connector modes.

vLLM's scheduler talks to a KV connector (``vllm/distributed/kv_transfer/kv_connector/
v1/base.py``, scheduler role) at three points: admission (``get_num_new_matched_tokens``
then ``update_state_after_alloc``), every step (``build_connector_meta``) and a
request's end (``request_finished_all_groups``). :class:`KVConformConnector` answers
from an external store the harness gives it (``lookup``: the tokens the store holds
beyond a computed prefix) and records what the scheduler told it; it moves no data
(there is no worker). The worker's half, reporting finished and failed receives, is
the harness's (:class:`properties.engines.vllm_scheduler.VLLMSchedulerHarness`).

Rules:

* ``get_num_new_matched_tokens(request, n)`` is ``(lookup(request_id, tokens, n),
  asynchronous and that > 0)``: the store's tokens beyond ``n``, loaded asynchronously
  in the ``async_loads`` mode;
* ``update_state_after_alloc(request, blocks, e)`` records a :class:`Told` (the block
  ids per group and ``e``); an asynchronous load with ``e > 0`` is queued for the worker
  (:meth:`take_loads`);
* ``request_finished_all_groups(request, block_ids)`` records the block ids told at the
  end and delays the free when ``saves(request_id)`` (then the blocks wait for the
  worker's ``finished_sending``: :meth:`take_saves`; a best-effort cache:
  ``requires_kv_delivery`` False); while saves are pending,
  ``has_pending_block_frees`` is True (the scheduler waits instead of preempting);
* ``reset_cache()`` calls ``reset`` (the harness empties the store).

Worked example: the store holds 8 tokens of ``r1``'s prompt; vLLM admits ``r1`` with no
device hit: ``get_num_new_matched_tokens(r1, 0) == (8, False)``, then
``update_state_after_alloc`` tells blocks ``([1, 2, 3],)`` and 8 external tokens:
``connector.told == [Told("r1", ((1, 2, 3),), 8)]``.

The class is found through ``KVTransferConfig(kv_connector="KVConformConnector",
kv_connector_module_path=__name__)``, as vLLM loads any external connector.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

#: ``lookup(request_id, token_ids, num_computed_tokens)``: external tokens beyond it.
Lookup = Callable[[str, tuple[int, ...], int], int]


@dataclass(frozen=True)
class Told:
    """What the scheduler told the connector about one request's blocks: at admission
    (``update_state_after_alloc``: ``num_external_tokens``) or at its end
    (``request_finished``: ``num_external_tokens`` is ``None``)."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_external_tokens: int | None


def _no_store(request_id: str, token_ids: tuple[int, ...], num_computed_tokens: int) -> int:
    return 0


def _never(request_id: str) -> bool:
    return False


def _nothing() -> None:
    return None


class KVConformConnector(KVConnectorBase_V1, SupportsHMA):
    """The stub (module docstring); ``lookup`` and ``asynchronous`` are set by the
    harness after vLLM builds it."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.lookup: Lookup = _no_store
        self.asynchronous = False
        #: whether a request's blocks are saved (kept) at its end
        self.saves: Callable[[str], bool] = _never
        #: empties the store (``reset_cache``)
        self.reset: Callable[[], None] = _nothing
        #: saves started and not handed to a step yet (:meth:`take_saves`)
        self._saves: list[str] = []
        #: saves not reported done by the worker yet
        self._pending_saves: set[str] = set()
        #: asynchronous loads not reported done by the worker yet
        self._unreported: set[str] = set()
        #: every admission's and end's blocks, in call order (the harness drains it)
        self.told: list[Told] = []
        #: asynchronous loads started and not reported by the worker yet
        self._loads: list[str] = []

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a dropped save is a future miss."""
        return False

    # -- scheduler side ----------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = tuple(request.all_token_ids)
        external = max(0, self.lookup(request.request_id, tokens, num_computed_tokens))
        return external, self.asynchronous and external > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        ids = tuple(tuple(group) for group in blocks.get_block_ids())
        self.told.append(Told(request.request_id, ids, num_external_tokens))
        if self.asynchronous and num_external_tokens > 0:
            self._loads.append(request.request_id)
            self._unreported.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        self.told.append(Told(request.request_id, tuple(tuple(g) for g in block_ids), None))
        # a request whose asynchronous load is not reported yet has nothing to save
        # (vLLM frees such a request's blocks when its load is reported, save or not)
        saves = self.saves(request.request_id) and request.request_id not in self._unreported
        if saves:
            self._saves.append(request.request_id)
            self._pending_saves.add(request.request_id)
        return saves, None

    def has_pending_block_frees(self) -> bool:
        return bool(self._pending_saves)

    def reset_cache(self) -> bool:
        self.reset()
        return True

    def take_saves(self) -> list[str]:
        """The saves started since the last call (the worker reports them with the
        output of the step scheduled now)."""
        saves, self._saves = self._saves, []
        return saves

    def saved(self, loads: list[str], saves: list[str]) -> None:
        """The worker reported these loads and saves done."""
        self._unreported.difference_update(loads)
        self._pending_saves.difference_update(saves)

    def take_loads(self) -> list[str]:
        """The asynchronous loads started since the last call (the worker reports them)."""
        loads, self._loads = self._loads, []
        return loads

    def take_told(self) -> list[Told]:
        """What the scheduler told since the last call."""
        told, self.told = self.told, []
        return told

    # -- worker side: there is no worker ------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any):
        return None

    def wait_for_save(self) -> None:
        return None


__all__ = ["KVConformConnector", "Lookup", "Told"]
