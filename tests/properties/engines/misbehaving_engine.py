"""An exec-protocol server that serves the reference engine correctly until one chosen
call, then misbehaves in one chosen way: the failures the exec client must report.

``python misbehaving_engine.py MODE CALL``: at the first request whose ``call`` is
``CALL`` it writes ``misbehaving at CALL`` to stderr, then

* ``hang``: never answers (sleeps);
* ``crash``: exits with status 7;
* ``segfault``: kills itself with SIGSEGV;
* ``garbage``: answers a line that is not JSON;
* ``wrong-id``: answers with another message id;
* ``version``: (for ``hello``) claims protocol version 99;
* ``settings``: (for ``hello``) declares an unknown production setting ``warp``;
* ``spec-types``: (for ``hello``) declares ``spec_types`` as the string ``"full"``;
* ``error``: answers an ``engine_error`` message;
* ``float-ids``: answers the right table with its first block id as a float (``3.0``);
* ``padded``: answers correctly, the line padded with 200 000 spaces (more than one read
  of the pipe).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from properties.engines.reference import make_engine  # noqa: E402
from properties.engines.serve import EngineServer, answer  # noqa: E402


def main() -> int:
    mode, target = sys.argv[1], sys.argv[2]
    server = EngineServer(make_engine, "misbehaving")
    for raw in sys.stdin.buffer:
        message = json.loads(raw)
        if message["call"] == target:
            print(f"misbehaving at {target}", file=sys.stderr, flush=True)
            if mode == "hang":
                time.sleep(3600)
            elif mode == "crash":
                sys.exit(7)
            elif mode == "segfault":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif mode == "garbage":
                reply = "this is not json"
            elif mode == "wrong-id":
                reply = json.dumps({"id": message["id"] + 100, "result": None})
            elif mode == "version":
                reply = json.dumps({"id": message["id"], "result": {"protocol": 99}})
            elif mode == "settings":
                result = {"protocol": 1, "name": "misbehaving", "production_settings": ["warp"]}
                reply = json.dumps({"id": message["id"], "result": result})
            elif mode == "spec-types":
                result = {"protocol": 1, "name": "misbehaving", "spec_types": "full"}
                reply = json.dumps({"id": message["id"], "result": result})
            elif mode == "error":
                reply = json.dumps(
                    {"id": message["id"], "error": {"kind": "engine_error", "message": "nope"}}
                )
            elif mode == "float-ids":
                response = answer(message, server)
                table = response["result"]
                table[0][0] = float(table[0][0])
                reply = json.dumps(response)
            elif mode == "padded":
                reply = json.dumps(answer(message, server)) + " " * 200_000
            else:
                raise SystemExit(f"unknown mode {mode!r}")
        else:
            reply = json.dumps(answer(message, server))
        sys.stdout.write(reply + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
