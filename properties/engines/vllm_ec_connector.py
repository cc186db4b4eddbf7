"""An encoder-cache (EC) connector stub for vLLM 0.33's scheduler: images another
instance encoded, loaded instead of computed (the scheduler level's ``remote_images``).

vLLM's scheduler asks an EC connector, per image of a request it schedules, whether the
image's encoder output is in the remote encoder cache (``has_cache_item``: then it is
loaded, costing no encoder compute budget) and, before it schedules a request with
images, whether every remote image it needs has arrived (``ensure_cache_available``:
False defers the request for the step). :class:`KVConformECConnector` answers by rule:

* images ``0`` and ``2`` (:data:`REMOTE_IMAGES`) are in the remote cache;
* a request that needs a remote image not computed yet waits for its transfer the
  first time the scheduler asks, and never again (the transfer takes one check).

It records what the scheduler told it (``update_state_after_alloc``,
``update_state_after_free``) and moves no data (there is no worker).

Worked example: ``r0`` (image 0 at positions 2-3) is checked with 0 computed tokens:
``ensure_cache_available`` is False (its transfer starts), the next check True; when it
is scheduled, image 0 is loaded (``has_cache_item("image-0")``) and ``r0``'s chunk spends
none of the encoder budget.

The class is found through ``ECTransferConfig(ec_connector="KVConformECConnector",
ec_connector_module_path=__name__, ec_role="ec_consumer")``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
)

#: the identifiers of the images the remote encoder cache holds
REMOTE_IMAGES: frozenset[str] = frozenset({"image-0", "image-2"})


class KVConformECConnector(ECConnectorBase):
    """The stub (module docstring)."""

    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config, role)
        #: requests whose remote images were asked for once (their transfer is done)
        self._transferred: set[str] = set()
        #: (request id, image index) the scheduler allocated or freed, in call order
        self.allocated: list[tuple[str, int]] = []
        self.freed: list[tuple[str, int]] = []

    # -- scheduler side ----------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return identifier in REMOTE_IMAGES

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        needed = any(
            f.identifier in REMOTE_IMAGES
            and f.mm_position.offset + f.mm_position.length > num_computed_tokens
            for f in request.mm_features or ()
        )
        if not needed or request.request_id in self._transferred:
            return True
        self._transferred.add(request.request_id)
        return False

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        self.allocated.append((request.request_id, index))

    def update_state_after_free(self, request: Any, index: int) -> None:
        self.freed.append((request.request_id, index))

    def build_connector_meta(self, scheduler_output: Any) -> ECConnectorMetadata:
        return ECConnectorMetadata()

    # -- worker side: there is no worker ------------------------------------------
    def start_load_caches(self, encoder_cache: Any, **kwargs: Any) -> None:
        return None

    def save_caches(self, encoder_cache: Any, mm_hash: str, **kwargs: Any) -> None:
        return None


__all__ = ["REMOTE_IMAGES", "KVConformECConnector"]
