"""``kvconform report TRACE.json [--html OUT.html]``: a failing trace as a web page.

The page is one self-contained file (inline CSS and JavaScript, no network, no CDN). It
walks the trace operation by operation: for each request holding blocks and each
group, the block table of the reference beside the engine's, cells that differ marked
``divergent``, null blocks (id 0) marked ``null`` and blocks in the prefix cache marked
``cached``; the pool after each operation (free count, the head of the free queue,
the cached blocks); the failing check with its rule (:mod:`properties.runner.explain`)
and the replay command. The data is embedded as JSON and the script renders the tables
(a browser that shows the highlighted cell has run the renderer).

How the sides are obtained: the trace is replayed on the engine under test (with its
checks, stopping at the failure) and, independently, on the reference (no checks); a
snapshot of both is taken after every operation. At the ``exact`` level the two must
agree, so a ``divergent`` cell is where the engine left the reference's policy; at the
``universal`` level differences are allowed and shown for orientation.

Worked example::

    kvconform report .kvconform/failures/20250101T120000Z-1a2b3c4d.json
    # -> .kvconform/failures/20250101T120000Z-1a2b3c4d.html
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from properties.core.output_files import write_text_atomic
from properties.core.trace import Trace, load_trace, operation_to_json
from reference.errors import KVConformError

# The runner is imported inside the functions: the CLI builds its parser (this module's
# add_report_parser) before a --coverage worker starts measuring the reference.


def report_path_for(trace_path: Path | str) -> Path:
    """The report written beside a trace: the same name with ``.html``."""
    return Path(trace_path).with_suffix(".html")


def _engine_side(
    trace: Trace, engine: str | None, factory
) -> tuple[str, list, str | None, str | None]:
    """``(engine name, snapshots, replay failure, why none)`` of the engine's side: the
    view recorded in the trace, or, when the user named an engine on the command line
    (``engine`` or a ``factory``), a replay on that engine. The engine the file names is
    never loaded (``docs/threat-model.md``)."""
    from properties.engines.under_test import resolve_engine
    from properties.runner.check import config_for
    from properties.runner.config import CheckConfig
    from properties.runner.engine_view import walk

    failure = trace.failure or {}
    view = trace.engine_view or {}
    if engine is None and factory is None:
        name = str(view.get("engine") or failure.get("engine") or "?")
        if "steps" in view:
            return name, list(view["steps"]), view.get("failure"), None
        why = view.get("omitted") or (
            "this trace carries no record of the engine's tables (a trace saved before "
            "kvconform recorded them, or written by hand)"
        )
        return (
            name,
            [],
            None,
            (f"{why}; `kvconform report TRACE --engine NAME` replays it on an engine you name"),
        )
    name = engine or getattr(factory, "__name__", "engine")
    level = failure.get("level") or "universal"
    prop = "attention" if failure.get("property") == "attention" else "invariants"
    config = config_for(prop, CheckConfig(engine=name, level=level))
    under_test = factory if factory is not None else resolve_engine(name, isolation="auto")
    try:
        steps, replay_failure = walk(trace, config, under_test)
    except KVConformError as exc:
        return name, [], None, f"the replay on {name} failed: {exc}"
    return name, steps, replay_failure, None


def report_data(
    trace: Trace, engine: str | None = None, level: str | None = None, factory=None
) -> dict:
    """Everything the page shows, as JSON data (see the module docstring). ``engine``
    or ``factory``: replay the trace on that engine for its side (the user's choice, on
    the command line); without either, the side recorded in the trace is shown."""
    from properties.engines.reference import make_engine as make_reference
    from properties.engines.under_test import resolve_engine
    from properties.runner.config import CheckConfig
    from properties.runner.engine_view import walk
    from properties.runner.explain import explain_failure, failing_operation, rule_line, where_line

    failure = trace.failure or {}
    name, engine_steps, engine_failure, missing = _engine_side(trace, engine, factory)
    level = level or failure.get("level") or "universal"
    ref_config = CheckConfig(engine="reference", level="universal")
    ref_steps, _ = walk(trace, ref_config, resolve_engine(make_reference))
    ops = [operation_to_json(op) for op in trace.operations]
    return {
        "engine": name,
        "level": level,
        "layout": trace.layout.describe(),
        "groups": [
            {"type": g.spec.type_name, "block_size": g.spec.block_size} for g in trace.layout.groups
        ],
        "num_blocks": trace.layout.num_blocks,
        "operations": ops,
        "engine_steps": engine_steps,
        "engine_missing": missing,
        "reference_steps": ref_steps,
        "failing_operation": failing_operation(trace) if failure else None,
        "check": failure.get("property"),
        "rule": rule_line(str(failure.get("property", "?"))) if failure else None,
        "where": where_line(trace) if failure else None,
        "explanation": explain_failure(trace) if failure else None,
        "replay_failure": engine_failure,
    }


def write_report(
    trace_path: Path | str,
    out: Path | str | None = None,
    engine: str | None = None,
    level: str | None = None,
    factory=None,
) -> Path:
    """Write the page for the trace at ``trace_path`` (default: beside it, ``.html``),
    whole or not at all; returns its path. ``engine``/``factory``: see
    :func:`report_data` (never the engine the file names)."""
    from properties.runner.check import replay_command

    trace = load_trace(Path(trace_path))
    data = report_data(trace, engine, level, factory)
    attention = data["check"] == "attention"
    options = str((trace.failure or {}).get("replay_options") or "")
    data["replay"] = replay_command(trace_path, data["engine"], data["level"], attention, options)
    path = Path(out) if out is not None else report_path_for(trace_path)
    return write_text_atomic(path, render_html(data), "the HTML report")


def report_beside(
    trace_path: Path | str, engine: str | None = None, factory=None
) -> tuple[Path | None, str]:
    """Write the page beside a saved trace (once: an existing page is kept), from the
    trace alone unless ``engine``/``factory`` name the engine to replay it on; returns its
    path and the line to print (``report: PATH``, or why it could not be written, in one
    line: a report never turns a run's result into an error)."""
    path = report_path_for(trace_path)
    if path.exists():
        return path, f"report: {path}"
    try:
        write_report(trace_path, path, engine, None, factory)
    except Exception as exc:  # noqa: BLE001 - the failure is reported whatever happens here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"report: not written ({type(exc).__name__}: {first[:300]})"
    return path, f"report: {path}"


def failure_lines(trace_path: Path | str | None, failure: str) -> list[str]:
    """The lines under a ``FAILED in ...: <first line>`` header: the rule, where it
    failed and the rest of the message (:func:`properties.runner.explain.explain_failure`);
    without a readable trace, the rest of the message."""
    rest = failure.splitlines()[1:]
    if trace_path is None:
        return [f"  {line}" for line in rest[:24]]
    try:
        trace = load_trace(Path(trace_path))
    except KVConformError:
        return [f"  {line}" for line in rest[:24]]
    from properties.runner.explain import explain_failure

    explained = explain_failure(trace).splitlines()
    return [f"  {explained[0]}", f"  {explained[1].strip()}", *[f"  {x}" for x in rest[:24]]]


def replay_lines(
    run: Any, exc: BaseException, trace_path: str, engine: str, level: str, factory=None
) -> list[str]:
    """What ``kvconform replay`` prints under its ``FAILED at operation N`` line: the
    rule and where it failed, the rest of the message, the last three calls (long
    lists shortened), the block tables that differ from the reference (as diffs, at
    most five requests) and the HTML report written beside the trace."""
    import json

    from properties.core.diff import describe_mismatch, short, size
    from properties.runner.explain import rule_line

    lines = [f"  {rule_line(getattr(exc, 'name', type(exc).__name__))}"]
    lines += [f"  {line}" for line in str(exc).splitlines()[1:24]]
    calls = run.lockstep.log[-3:]
    if calls:
        lines.append("  last calls (engine under test):")
        for c in calls:
            shown = {
                k: (short(v) if isinstance(v, list) and size(v) > 16 else v) for k, v in c.items()
            }
            lines.append(f"    {json.dumps(shown)[:300]}")
    reference = run.lockstep.reference
    if reference is not None:
        differing = []
        for rid, tracked in run.lockstep.checker.requests.items():
            if not tracked.holds_blocks:
                continue
            try:
                exp = [list(map(int, g)) for g in reference.get_block_ids(rid)]
                got = [list(map(int, g)) for g in run.lockstep.engine.get_block_ids(rid)]
            except Exception as err:  # noqa: BLE001 - shown, not raised
                differing.append(f"    {rid}: cannot read tables: {err}")
                continue
            if exp != got:
                names = ("reference", run.lockstep.engine_name)
                differing.append(f"    {rid}: {describe_mismatch(exp, got, names)}")
        if differing:
            lines.append(f"  block tables that differ ({len(differing)} requests):")
            lines += differing[:5]
        else:
            lines.append("  every block table equals the reference's")
    _path, line = report_beside(trace_path, engine, factory)
    lines.append(f"  {line}")
    return lines


def cmd_report(args) -> int:
    """``kvconform report TRACE [--html OUT] [--engine E] [--level L]``: the page from the
    trace alone; ``--engine`` replays it on that engine for the engine's side."""
    from properties.core.output_files import check_output_file

    out = check_output_file(args.html, "--html") if args.html is not None else None
    if out is None:
        check_output_file(report_path_for(args.trace), "the page beside the trace")
    path = write_report(args.trace, out, args.engine, args.level)
    print(f"report: {path}")
    return 0


def add_report_parser(sub) -> None:
    """The ``report`` subcommand of the ``kvconform`` parser."""
    p = sub.add_parser(
        "report",
        help="write a self-contained HTML page of a failing trace (from the file alone: "
        "the engine it names is never run)",
    )
    p.add_argument("trace")
    p.add_argument("--html", default=None, help="where to write it (default: beside the trace)")
    p.add_argument(
        "--engine",
        default=None,
        help="replay the trace on this engine for the engine's side (default: the side "
        "recorded in the trace)",
    )
    p.add_argument("--level", default=None, choices=("universal", "exact"))
    p.add_argument("--verbose", action="store_true", help="tracebacks for errors")
    p.set_defaults(func=cmd_report)


def render_html(data: dict) -> str:
    """The page: static header plus the JSON data and the renderer (inline)."""
    # every "<" escaped: no request id or message can end the script element or open an
    # HTML comment inside it (``<!--<script>`` would blank the page)
    payload = json.dumps(data).replace("<", "\\u003c")
    title = html.escape(f"kvconform report: {data.get('check') or 'trace'} on {data['engine']}")
    return _PAGE.replace("__TITLE__", title).replace("__DATA__", payload)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.2em}
pre{background:#f6f6f6;padding:.6em;white-space:pre-wrap}
table.blocks{border-collapse:collapse;margin:.2em 0}
table.blocks td{border:1px solid #bbb;min-width:2.4em;text-align:center;padding:1px 3px}
.null{background:#ddd;color:#777}
.cached{background:#dff0d8}
.divergent{background:#f8b4b4;font-weight:bold;outline:2px solid #c00}
.side{display:inline-block;vertical-align:top;margin-right:2em}
.legend span{padding:0 .5em;margin-right:.5em;border:1px solid #bbb}
.ops li.current{font-weight:bold}.ops li.failing{color:#c00}
button{margin-right:.4em}
</style></head><body>
<h1 id="title"></h1>
<div id="failure"></div>
<div id="nav"><button id="first">first</button><button id="prev">previous</button>
<button id="next">next</button><button id="last">failing step</button>
<span id="position"></span></div>
<p class="legend">cells: <span class="null">0 null block</span><span class="cached">cached</span>
<span class="divergent">engine differs from the reference</span></p>
<div id="step"></div>
<h2>Operations</h2><ol class="ops" start="0" id="ops"></ol>
<script id="data" type="application/json">__DATA__</script>
<script>
(function () {
  var D = JSON.parse(document.getElementById("data").textContent);
  // every operation can be shown; a side without a snapshot there says so
  var n = D.operations.length;
  var failing = D.failing_operation ? D.failing_operation[0] : -1;
  var cur = failing >= 0 ? failing : Math.max(0, n - 1);
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function add(parent, child) { parent.appendChild(child); return child; }
  document.getElementById("title").textContent =
    "kvconform report: " + (D.check || "trace") + " on " + D.engine + " (" + D.level + ")";
  var f = document.getElementById("failure");
  if (D.rule) {
    add(f, el("h2", {}, "Failing check"));
    add(f, el("pre", {id: "rule"}, D.explanation));
  }
  if (D.engine_missing) add(f, el("p", {id: "engine-missing"}, "engine side: " + D.engine_missing));
  add(f, el("p", {}, "layout: " + D.layout));
  add(f, el("h2", {}, "Replay"));
  add(f, el("pre", {id: "replay"}, D.replay || ""));
  function cachedSet(s) {
    var c = {};
    ((s && s.cached) || []).forEach(function (b) { c[b] = 1; });
    return c;
  }
  function table(rows, other, cached, side, rid) {
    var t = el("table", {"class": "blocks"});
    rows.forEach(function (row, g) {
      var tr = add(t, el("tr"));
      add(tr, el("th", {}, "g" + g + " " + (D.groups[g] ? D.groups[g].type : "")));
      row.forEach(function (b, i) {
        var cls = [];
        if (b === 0) cls.push("null");
        else if (cached[b]) cls.push("cached");
        var o = other && other[g] ? other[g][i] : undefined;
        if (other && o !== b) cls.push("divergent");
        add(tr, el("td", {"class": cls.join(" "), "data-request": rid, "data-group": g,
                          "data-index": i, "data-side": side}, String(b)));
      });
      if (other && other[g] && other[g].length > row.length) {
        add(tr, el("td", {"class": "divergent", "data-side": side}, "(missing)"));
      }
    });
    return t;
  }
  function pool(s, ref, label) {
    var d = el("div", {"class": "side"});
    add(d, el("h3", {}, label));
    if (!s) { add(d, el("p", {}, "(no snapshot)")); return d; }
    var p = add(d, el("p", {}, "free blocks: " + s.free));
    if (ref && ref.free !== s.free) p.className = "divergent";
    if (s.queue) {
      add(d, el("div", {}, "free queue head (front first):"));
      var qr = add(add(d, el("table", {"class": "blocks queue"})), el("tr"));
      s.queue.forEach(function (b, i) {
        var td = add(qr, el("td", {"data-side": ref ? "engine" : "reference",
                                   "data-queue-index": i}, String(b)));
        if (ref && ref.queue && ref.queue[i] !== b) td.className = "divergent";
      });
    }
    if (s.cached) {
      add(d, el("p", {}, "cached blocks (" + s.cached_count + "): " +
                         s.cached.slice(0, 64).join(", ")));
    }
    if (s.pools && typeof s.pools === "object") {
      var pl = add(d, el("p", {"class": "pools"}, "free per pool: "));
      Object.keys(s.pools).forEach(function (name) {
        var sp = add(pl, el("span", {}, name + " " + s.pools[name] + " "));
        if (ref && ref.pools && ref.pools[name] !== s.pools[name]) sp.className = "divergent";
      });
    }
    if (s.ref_counts && typeof s.ref_counts === "object") {
      add(d, el("div", {}, "reference counts (block: holders; blocks with none omitted):"));
      var rr = add(add(d, el("table", {"class": "blocks refs"})), el("tr"));
      var keys = {};
      Object.keys(s.ref_counts).forEach(function (b) { keys[b] = 1; });
      if (ref && ref.ref_counts) Object.keys(ref.ref_counts).forEach(function (b) { keys[b] = 1; });
      Object.keys(keys).sort(function (a, b) { return a - b; }).forEach(function (b) {
        var v = s.ref_counts[b] || 0;
        var td = add(rr, el("td", {"data-block": b, "data-side": ref ? "engine" : "reference"},
                               b + ": " + v));
        if (ref && ref.ref_counts && (ref.ref_counts[b] || 0) !== v) td.className = "divergent";
      });
    }
    return d;
  }
  function side(label, tables, rid, other, snap, name) {
    var box = el("div", {"class": "side"});
    add(box, el("div", {}, label));
    var rows = tables && tables[rid];
    if (!tables) add(box, el("p", {}, "(not recorded at this operation)"));
    else if (Array.isArray(rows)) add(box, table(rows, other, cachedSet(snap), name, rid));
    else add(box, el("p", {}, rows || "(holds no blocks)"));
    return box;
  }
  function render() {
    var box = document.getElementById("step");
    box.innerHTML = "";
    var e = D.engine_steps[cur], r = D.reference_steps[cur];
    document.getElementById("position").textContent =
      "operation " + cur + " of " + (n - 1) + (cur === failing ? " (the failing operation)" : "");
    add(box, el("h2", {}, "After operation " + cur + ": " + JSON.stringify(D.operations[cur])));
    var rids = {};
    [e, r].forEach(function (s) { if (s) for (var k in s.tables) rids[k] = 1; });
    Object.keys(rids).sort().forEach(function (rid) {
      var w = add(box, el("div", {"class": "request"}));
      add(w, el("h3", {}, "request " + rid));
      var rt = r && r.tables[rid];
      add(w, side("reference", r && r.tables, rid, null, r, "reference"));
      add(w, side(D.engine, e && e.tables, rid, Array.isArray(rt) ? rt : [], e, "engine"));
    });
    if (e && e.calls) {
      add(box, el("h2", {}, "The engine's last calls"));
      add(box, el("pre", {id: "calls"}, e.calls.join("\\n")));
    }
    var pw = add(box, el("div"));
    add(pw, el("h2", {}, "Pool"));
    add(pw, pool(r, null, "reference"));
    add(pw, pool(e, r, D.engine));
    var items = document.getElementById("ops").children;
    for (var i = 0; i < items.length; i++) {
      items[i].className = (i === cur ? "current " : "") + (i === failing ? "failing" : "");
    }
  }
  var ol = document.getElementById("ops");
  D.operations.forEach(function (op, i) {
    var li = add(ol, el("li", {}, JSON.stringify(op)));
    li.onclick = function () { cur = i; render(); };
  });
  function go(to) { return function () { cur = Math.min(Math.max(0, to()), n - 1); render(); }; }
  document.getElementById("first").onclick = go(function () { return 0; });
  document.getElementById("prev").onclick = go(function () { return cur - 1; });
  document.getElementById("next").onclick = go(function () { return cur + 1; });
  document.getElementById("last").onclick = go(function () {
    return failing >= 0 ? failing : n - 1;
  });
  if (n > 0) render();
  else document.getElementById("step").textContent = "the engine failed before any operation";
})();
</script></body></html>
"""
