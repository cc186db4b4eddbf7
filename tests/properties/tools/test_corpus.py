"""The conformance corpus: export, then replay without Hypothesis (``docs/corpus-format.md``).

* the export covers every spec type, every preset and every kind of operation, and is
  the same file for file when exported twice;
* the reference passes its own corpus at both levels, also through the exec protocol;
* a case edited to expect a wrong block id fails with a message naming the case, the
  operation, the expected call and both values;
* a corpus of another version, or a broken file, is refused with a clear message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from properties.generate.strategies import PRESET_ORDER, SPEC_KINDS
from properties.tools.cli import main
from properties.tools.corpus import (
    CORPUS_FORMAT,
    MODES,
    CorpusError,
    export_corpus,
    load_manifest,
    run_corpus,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("corpus")
    export_corpus(directory, per_mode=2)
    return directory


def test_every_engine_kind_gets_cases_it_can_run(corpus: Path) -> None:
    """An engine of one spec type runs only the cases made of it: each gets at least
    three modes' worth (its kind, tight pools, caching off), with prefix caching on and
    off and a pool small enough to refuse allocations; a full + sliding-window engine
    (SGLang, LMDeploy) at least its two kinds' and their mix. Issue 42: a full-attention
    engine had 4 cases of 52."""
    cases = load_manifest(corpus)["cases"]

    def runnable(kinds: set[str]) -> list[dict]:
        return [c for c in cases if set(c["spec_types"]) <= kinds]

    for kind in SPEC_KINDS:
        mine = runnable({kind})
        assert len(mine) >= 3 * 2, (kind, len(mine))  # 2 cases a mode in this corpus
        assert {f"kind:{kind}", f"pressure:{kind}", f"no-caching:{kind}"} <= {
            c["mode"] for c in mine
        }
        caching = {json.loads((corpus / c["file"]).read_text())["trace"]["layout"]
                   ["enable_caching"] for c in mine}  # fmt: skip
        assert caching == {True, False}, kind
    assert len(runnable({"full", "sliding_window"})) >= 3 * len(runnable({"full"}))


def test_export_covers_every_mode(corpus: Path) -> None:
    manifest = load_manifest(corpus)
    assert manifest["format"] == CORPUS_FORMAT
    assert len(manifest["cases"]) == 2 * len(MODES)
    assert set(manifest["spec_types"]) == set(SPEC_KINDS)
    assert {f"preset:{p}" for p in PRESET_ORDER} <= {c["mode"] for c in manifest["cases"]}
    coverage = manifest["coverage"]
    for key in (
        "preempt_ops",
        "abort_ops",
        "reset_ops",
        "lookahead_steps",
        "salted_or_lora",
        "hits",
        "refused_allocations",
    ):
        assert coverage[key] > 0, key
    case = json.loads((corpus / manifest["cases"][0]["file"]).read_text())
    assert case["trace"]["format"] == "kvconform-trace/1"
    calls = {e["call"] for e in case["expected"]}
    assert {"add_request", "new_step", "get_computed_blocks", "allocate_slots"} <= calls
    allocation = next(e for e in case["expected"] if e["call"] == "allocate_slots")
    assert {"num_free_blocks", "free_queue"} <= set(allocation["after"])


def test_export_is_deterministic(tmp_path) -> None:
    modes = ("kind:sliding_window", "preset:gemma3")
    export_corpus(tmp_path / "a", per_mode=1, modes=modes)
    export_corpus(tmp_path / "b", per_mode=1, modes=modes)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.json"))
    assert len(files) == 3
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("level", ["universal", "exact"])
def test_reference_passes_its_corpus(corpus: Path, level: str) -> None:
    report = run_corpus(corpus, "reference", level)
    assert report.count("pass") == 2 * len(MODES), [r.message for r in report.results]


def test_batching_engine_passes_exact(corpus: Path) -> None:
    """The optimized engine allocates a step's running requests in one batch: the
    lockstep engine then asks for the tables after the whole batch, and the corpus still
    answers with the state of that moment."""
    report = run_corpus(corpus, "optimized", "exact")
    assert report.count("pass") == 2 * len(MODES), [r.message for r in report.results]


def test_reference_behind_the_exec_protocol_passes_exact(corpus: Path) -> None:
    engine = f"exec:{sys.executable} -m properties.engines.serve reference"
    report = run_corpus(corpus, engine, "exact")
    assert report.count("pass") == 2 * len(MODES), [r.message for r in report.results]


def test_wrong_expected_block_id_fails_clearly(corpus: Path, tmp_path, capsys) -> None:
    edited = tmp_path / "edited"
    edited.mkdir()
    manifest = load_manifest(corpus)
    (edited / "manifest.json").write_text((corpus / "manifest.json").read_text())
    (edited / "cases").mkdir()
    for entry in manifest["cases"]:
        (edited / entry["file"]).write_text((corpus / entry["file"]).read_text())
    first = manifest["cases"][0]
    case = json.loads((edited / first["file"]).read_text())
    index, entry = next(
        (i, e)
        for i, e in enumerate(case["expected"])
        if e["call"] == "allocate_slots" and e["result"] and e["result"][0]
    )
    right = entry["result"][0][0]
    entry["result"][0][0] = right + 1000
    (edited / first["file"]).write_text(json.dumps(case))

    code = main(["corpus", "run", str(edited), "--engine", "reference", "--level", "exact"])
    out = capsys.readouterr().out
    assert code == 1
    line = next(x for x in out.splitlines() if x.startswith("  FAIL"))
    assert first["name"] in line and first["file"] in line
    assert f"expected call {index} allocate_slots" in line
    assert f"the corpus gives [[{right + 1000}" in line and f"reference gives [[{right}" in line
    assert f"{2 * len(MODES) - 1} passed, 1 failed, 0 skipped" in out
    # the universal level does not read the expected results
    assert main(["corpus", "run", str(edited), "--engine", "reference"]) == 0


def test_other_versions_and_broken_files_are_refused(corpus: Path, tmp_path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "kvconform-corpus/2"}))
    with pytest.raises(CorpusError, match="unsupported corpus version 'kvconform-corpus/2'"):
        run_corpus(tmp_path, "reference")
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(CorpusError, match="is not valid JSON: .* at line 1"):
        run_corpus(tmp_path, "reference")
    with pytest.raises(CorpusError, match="corpus manifest .* does not exist"):
        run_corpus(tmp_path / "missing", "reference")
    assert main(["corpus", "run", str(tmp_path / "missing")]) == 2
    assert main(["corpus", "export", str(tmp_path / "x"), "--per-mode", "0"]) == 2
