"""The mutants' registry: per-manager classes, registration and the --engine address."""

from __future__ import annotations

import pytest

from properties.core.engine import load_engine_factory
from properties.mutants import MUTANT_INFO, managers
from properties.mutants.registry import MutantInfo, Registry, collect, per_manager
from reference.managers import FullAttentionManager, SlidingWindowManager


class _Bug:
    """A bug written once."""

    def remove_skipped_blocks(self, request_id, num_computed_tokens):
        return ("bug", num_computed_tokens)


def test_per_manager_builds_one_subclass_per_manager() -> None:
    classes = per_manager(_Bug, FullAttentionManager, SlidingWindowManager)
    assert list(classes) == [FullAttentionManager, SlidingWindowManager]
    swa = classes[SlidingWindowManager]
    assert swa.__name__ == "BugSlidingWindowManager"
    assert swa.__mro__[1:3] == (_Bug, SlidingWindowManager)
    assert swa.__doc__ == "A bug written once."
    assert issubclass(classes[FullAttentionManager], FullAttentionManager)


def test_registry_names_the_mutant_after_its_factory() -> None:
    registry = Registry("some.module", production_settings=["eagle"])

    @registry.mutant("exact", ["exact_match"], "a bug", "production")
    def make_some_bug(layout):
        return None

    (info,) = registry.entries
    assert info == MutantInfo(
        "some_bug", "a bug", "exact", frozenset({"exact_match"}), make_some_bug, "production",
        "some.module",
    )  # fmt: skip
    assert info.target == "some.module:make_some_bug"
    assert make_some_bug.production_settings == frozenset({"eagle"})
    with pytest.raises(ValueError, match="'some_bug' is registered twice"):
        collect(registry, registry)


def test_every_mutant_is_addressed_through_reference_mutants() -> None:
    info = MUTANT_INFO["swa_off_by_one"]
    assert info.factory is managers.make_swa_off_by_one
    target = "properties.mutants.reference_mutants:make_swa_off_by_one"
    assert info.target == target
    assert load_engine_factory(target) is managers.make_swa_off_by_one
