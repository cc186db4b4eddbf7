"""The conformance checks as ``@given`` tests under the public name, for HypoFuzz:
``hypothesis fuzz -- --pyargs kvconform.fuzz_targets --kv-engine mypkg.adapter:make_engine
--kv-profile nightly``
(see :mod:`properties.tools.fuzz_targets` and ``docs/fuzz-campaigns.md``)."""

from properties.tools.fuzz_targets import (
    test_attention_trace,
    test_invariants_trace,
    test_production_trace,
)

__all__ = ["test_attention_trace", "test_invariants_trace", "test_production_trace"]
