"""The reference engine calling into :mod:`tests.properties.tools.toy_cov_module` (a test
fixture for engine coverage, not part of the package): name it on the command line as
``tests.properties.tools.toy_cov_adapter:make_engine``; its ``coverage_modules`` name the
toy module, so ``--engine-coverage`` with no value measures it."""

from __future__ import annotations

from properties.core.engine import RequestInput
from properties.engines.reference import ReferenceEngine
from reference.layout import KVCacheLayout
from tests.properties.tools import toy_cov_module


class ToyCovEngine(ReferenceEngine):
    """The reference engine; building it and adding a request run toy module code."""

    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        toy_cov_module.parity(0)
        toy_cov_module.parity(1)

    def add_request(self, request: RequestInput) -> None:
        toy_cov_module.checked_size(len(request.prompt_token_ids))
        super().add_request(request)


def make_engine(layout: KVCacheLayout) -> ToyCovEngine:
    return ToyCovEngine(layout)


make_engine.coverage_modules = ("tests.properties.tools.toy_cov_module",)  # type: ignore[attr-defined]
