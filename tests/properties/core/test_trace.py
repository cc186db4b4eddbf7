"""Traces: JSON encoding written by hand, round trips, file saving and clear errors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings

from properties.core.trace import (
    TRACE_FORMAT,
    Abort,
    Arrive,
    Preempt,
    ResetPrefixCache,
    Step,
    Trace,
    TraceFormatError,
    layout_from_json,
    layout_to_json,
    load_trace,
    save_trace,
    trace_from_json,
    trace_to_json,
    validate_references,
)
from properties.generate.strategies import traces
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "trace-format.md"


def tiny_layout() -> KVCacheLayout:
    return KVCacheLayout(
        groups=(KVCacheGroup(("layer.0",), FullAttentionSpec(block_size=4)),),
        num_blocks=8,
        max_model_len=16,
    )


def four_kinds_layout() -> KVCacheLayout:
    """One group of each spec kind; Mamba at the gcd block size 2, chunked at the lcm 8."""
    return KVCacheLayout(
        groups=(
            KVCacheGroup(("a", "b"), SlidingWindowSpec(block_size=4, sliding_window=3)),
            KVCacheGroup(("c",), FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=4)),
            KVCacheGroup(
                ("d",), MambaSpec(block_size=2, shapes=((4, 8), (2,)), page_size_padded=200)
            ),
            KVCacheGroup(
                ("e",),
                ChunkedLocalAttentionSpec(
                    block_size=8, attention_chunk_size=6, page_size_padded=1000
                ),
            ),
        ),
        num_blocks=30,
        max_model_len=40,
        enable_caching=True,
        max_in_flight_tokens=12,
        name="mixed",
    )


def full_trace() -> Trace:
    return Trace(
        layout=four_kinds_layout(),
        operations=(
            Arrive("r0", (1, 2, 3), (4, 5), cache_salt="s1", lora_name="lora-a"),
            Step(4, num_lookahead_tokens=2),
            Arrive("r1", (1, 2), ()),
            Preempt("r0"),
            ResetPrefixCache(),
            Abort("r1"),
            Step(1),
        ),
        seed=1234,
        observed=({"calls": [["allocate_slots", "r0", 4]], "result": {"ok": True}},),
        failure={"property": "I1", "message": "leak", "engine": "reference", "level": "universal"},
    )


def test_small_trace_json_is_the_documented_encoding():
    trace = Trace(
        layout=tiny_layout(),
        operations=(Arrive("r0", (1, 2, 3, 4, 5, 6), (7, 0)), Step(4), Step(4), Step(4)),
    )
    expected = {
        "format": "kvconform-trace/1",
        "seed": None,
        "layout": {
            "name": "",
            "num_blocks": 8,
            "max_model_len": 16,
            "enable_caching": True,
            "max_in_flight_tokens": None,
            "prefix_cache_retention_interval": None,
            "use_eagle": False,
            "num_hash_lookahead_tokens": 0,
            "groups": [
                {
                    "layer_names": ["layer.0"],
                    "spec": {
                        "type": "full",
                        "block_size": 4,
                        "num_kv_heads": 1,
                        "head_size": 8,
                        "dtype_bytes": 2,
                        "page_size_padded": None,
                    },
                    "is_eagle_group": False,
                }
            ],
        },
        "mode": {
            "async_scheduling": False,
            "admission_gate": False,
            "num_draft_tokens": 0,
            "external_hits": False,
            "async_loads": False,
            "load_failures": False,
            "varying_drafts": False,
        },
        "operations": [
            {
                "op": "arrive",
                "request_id": "r0",
                "prompt": [1, 2, 3, 4, 5, 6],
                "output": [7, 0],
                "cache_salt": None,
                "lora_name": None,
            },
            {"op": "step", "token_budget": 4, "num_lookahead_tokens": 0},
            {"op": "step", "token_budget": 4, "num_lookahead_tokens": 0},
            {"op": "step", "token_budget": 4, "num_lookahead_tokens": 0},
        ],
        "observed": [],
        "failure": None,
    }
    assert trace_to_json(trace) == expected


def test_documented_example_loads():
    blocks = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)
    example = json.loads(next(b for b in blocks if '"format"' in b))
    trace = trace_from_json(example)
    assert trace.operations[0] == Arrive("r0", (1, 2, 3, 4, 5, 6), (7, 0))
    assert trace.operations[1:] == (Step(4),) * 3
    assert trace.layout.groups[0].spec == FullAttentionSpec(block_size=4)


def test_every_spec_field_is_written():
    data = layout_to_json(four_kinds_layout())
    assert data["max_in_flight_tokens"] == 12
    assert data["name"] == "mixed"
    assert data["groups"][0] == {
        "layer_names": ["a", "b"],
        "spec": {
            "type": "sliding_window",
            "block_size": 4,
            "num_kv_heads": 1,
            "head_size": 8,
            "dtype_bytes": 2,
            "page_size_padded": None,
            "sliding_window": 3,
        },
        "is_eagle_group": False,
    }
    assert data["groups"][2]["spec"] == {
        "type": "mamba",
        "block_size": 2,
        "shapes": [[4, 8], [2]],
        "dtype_bytes": 2,
        "page_size_padded": 200,
        "mamba_cache_mode": "align",
        "num_speculative_blocks": 0,
        "num_prefill_checkpoint_blocks": 0,
        "prefill_checkpoint_alignment": None,
    }
    assert data["groups"][3]["spec"]["attention_chunk_size"] == 6
    assert data["groups"][3]["spec"]["page_size_padded"] == 1000


def test_layout_round_trip_all_spec_kinds():
    layout = four_kinds_layout()
    back = layout_from_json(json.loads(json.dumps(layout_to_json(layout))))
    assert back == layout
    assert back.name == "mixed"  # name does not take part in equality
    assert back.groups[2].spec.shapes == ((4, 8), (2,))


def test_full_trace_round_trip_through_text():
    trace = full_trace()
    back = trace_from_json(json.loads(json.dumps(trace_to_json(trace))))
    assert back == trace
    assert back.observed[0]["calls"] == [["allocate_slots", "r0", 4]]


def test_observed_tuples_are_normalised_to_lists():
    trace = Trace(layout=tiny_layout(), operations=(), observed=({"ids": ((1, 2), (3,))},))
    assert trace.observed == ({"ids": [[1, 2], [3]]},)
    assert trace_from_json(trace_to_json(trace)) == trace


def test_observed_must_be_json_data():
    with pytest.raises(TraceFormatError, match=r"Trace.observed\[0\].x .*object"):
        Trace(layout=tiny_layout(), operations=(), observed=({"x": object()},))


@settings(max_examples=100, derandomize=True, database=None, deadline=None)
@given(traces(max_ops=20))
def test_generated_traces_round_trip(trace):
    assert trace_from_json(json.loads(json.dumps(trace_to_json(trace)))) == trace


def test_unknown_spec_type_is_a_clear_error():
    data = layout_to_json(tiny_layout())
    data["groups"][0]["spec"]["type"] = "mla"
    with pytest.raises(TraceFormatError, match=r"layout.groups\[0\].spec.type: .*'mla'"):
        layout_from_json(data)
    assert issubclass(TraceFormatError, KVConformError)


def test_unknown_spec_field_is_a_clear_error():
    data = layout_to_json(tiny_layout())
    data["groups"][0]["spec"]["sink_len"] = 4
    with pytest.raises(TraceFormatError, match=r"layout.groups\[0\].spec.sink_len"):
        layout_from_json(data)


def test_invalid_layout_values_name_the_field():
    data = layout_to_json(tiny_layout())
    data["num_blocks"] = 1
    with pytest.raises(TraceFormatError, match="num_blocks must be >= 2"):
        layout_from_json(data)
    data = layout_to_json(tiny_layout())
    del data["max_model_len"]
    with pytest.raises(TraceFormatError, match="layout.max_model_len is missing"):
        layout_from_json(data)


def test_wrong_format_and_version():
    data = trace_to_json(Trace(layout=tiny_layout(), operations=()))
    data["format"] = "kvconform-trace/2"
    with pytest.raises(TraceFormatError, match="unsupported trace version 'kvconform-trace/2'"):
        trace_from_json(data)
    data["format"] = "something-else"
    with pytest.raises(TraceFormatError, match="not a kvconform trace"):
        trace_from_json(data)
    del data["format"]
    with pytest.raises(TraceFormatError, match="not a kvconform trace"):
        trace_from_json(data)


def test_bad_operation_names_its_index_and_field():
    data = trace_to_json(Trace(layout=tiny_layout(), operations=(Arrive("r0", (1,)), Step(2))))
    data["operations"][1]["token_budget"] = 0
    with pytest.raises(TraceFormatError, match=r"operations\[1\]: Step.token_budget .* got 0"):
        trace_from_json(data)
    data["operations"][1] = {"op": "evict"}
    with pytest.raises(TraceFormatError, match=r"operations\[1\].op: unknown operation 'evict'"):
        trace_from_json(data)


def test_operation_validation():
    with pytest.raises(TraceFormatError, match="Arrive.prompt must hold at least 1"):
        Arrive("r0", ())
    with pytest.raises(TraceFormatError, match="Arrive.prompt must be a tuple"):
        Arrive("r0", [1, 2])
    with pytest.raises(TraceFormatError, match="Arrive.output must hold integers >= 0"):
        Arrive("r0", (1,), (-1,))
    with pytest.raises(TraceFormatError, match="Step.num_lookahead_tokens"):
        Step(1, -1)
    with pytest.raises(TraceFormatError, match="Abort.request_id"):
        Abort("")


def test_references_must_name_earlier_arrivals():
    with pytest.raises(TraceFormatError, match=r"operations\[0\] \(abort\) names request_id 'r0'"):
        validate_references((Abort("r0"), Arrive("r0", (1,))))
    with pytest.raises(TraceFormatError, match=r"operations\[1\] \(arrive\) reuses"):
        validate_references((Arrive("r0", (1,)), Arrive("r0", (2,))))
    with pytest.raises(TraceFormatError, match=r"operations\[2\] \(preempt\) .* earlier abort"):
        validate_references((Arrive("r0", (1,)), Abort("r0"), Preempt("r0")))
    with pytest.raises(TraceFormatError, match=r"operations\[2\] \(abort\) .* earlier abort"):
        validate_references((Arrive("r0", (1,)), Abort("r0"), Abort("r0")))
    validate_references((Arrive("r0", (1,)), Preempt("r0"), Preempt("r0"), Abort("r0")))


def test_save_and_load(tmp_path):
    trace = full_trace()
    directory = tmp_path / "nested" / "failures"
    path = save_trace(trace, directory)
    assert path.parent == directory
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{8}\.json", path.name)
    unseeded = json.loads(path.read_text())
    unseeded["seed"] = None  # the name's digest leaves the seed out
    text = json.dumps(unseeded, indent=2, sort_keys=True) + "\n"
    assert path.name[-13:-5] == hashlib.sha256(text.encode()).hexdigest()[:8]
    assert json.loads(path.read_text())["format"] == TRACE_FORMAT
    assert load_trace(path) == trace
    # the same failure found again (another seed) is not saved twice
    again = save_trace(dataclasses.replace(trace, seed=12345), directory)
    assert again == path and len(list(directory.iterdir())) == 1


def test_load_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(TraceFormatError, match=r"nope.json.*does not exist"):
        load_trace(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": ')
    with pytest.raises(TraceFormatError, match=r"bad.json.*not valid JSON.*line 1"):
        load_trace(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"format": "kvconform-trace/9"}')
    with pytest.raises(TraceFormatError, match=r"wrong.json.*trace.format: unsupported"):
        load_trace(wrong)
    listing = tmp_path / "list.json"
    listing.write_text("[]")
    with pytest.raises(TraceFormatError, match=r"list.json.*must be a JSON object"):
        load_trace(listing)


def test_production_fields_and_mode_round_trip():
    """Retention, EAGLE, lookahead hashes, EAGLE groups and the serving mode survive JSON."""
    import dataclasses

    from properties.core.modes import ServingMode
    from properties.core.trace import trace_from_json

    layout = tiny_layout()
    layout = dataclasses.replace(
        layout,
        groups=(dataclasses.replace(layout.groups[0], is_eagle_group=True),),
        prefix_cache_retention_interval=0,
        use_eagle=True,
        num_hash_lookahead_tokens=1,
    )
    mode = ServingMode(async_scheduling=True, admission_gate=True, external_hits=True)
    trace = Trace(layout=layout, operations=(Step(4),), mode=mode)
    data = trace_to_json(trace)
    assert data["mode"] == {
        "async_scheduling": True,
        "admission_gate": True,
        "num_draft_tokens": 0,
        "external_hits": True,
        "async_loads": False,
        "load_failures": False,
        "varying_drafts": False,
    }
    assert data["layout"]["prefix_cache_retention_interval"] == 0
    back = trace_from_json(json.loads(json.dumps(data)))
    assert back.layout == layout and back.mode == mode
    assert back.layout.groups[0].is_eagle_group
    data["mode"]["async"] = True
    with pytest.raises(TraceFormatError, match="trace.mode.async: unknown field"):
        trace_from_json(data)
