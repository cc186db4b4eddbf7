"""Campaigns across machines: ``kvconform fuzz --database redis://HOST:PORT``.

A real ``redis-server`` (installed by ``ci/setup``) is started on the loopback address
with a free port and no persistence, and stopped at the end. Two fuzz campaigns (two
workers with different seeds and failure folders, as on two machines) point at it:
the first finds a mutant's bug, Hypothesis stores the failing example in Redis, and the
second replays that very example before generating anything. An unreachable server is
refused up front with one line.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from properties.mutants.reference_mutants import MUTANTS
from properties.tools.fuzz import run_campaign

#: A mutant whose failure Hypothesis finds and shrinks in seconds.
MUTANT = MUTANTS["null_block_handed_out"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (ci/setup installs it with apt-get)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    import redis

    port = _free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail(f"redis-server did not answer on 127.0.0.1:{port}")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_failure_found_by_one_worker_is_replayed_by_another(redis_url, tmp_path, capsys) -> None:
    import redis

    first = run_campaign(
        engine=MUTANT,
        minutes=0.2,  # room for the worker to start on a busy machine
        workers=1,
        seed=11,
        failure_dir=str(tmp_path / "machine-a"),
        database=redis_url,
    )
    out_a = capsys.readouterr().out
    # the mutant's free count includes the null block: more free blocks than the pool
    # has, a pool_accounting violation (exit code 1)
    assert first == 1, out_a
    found = next(line for line in out_a.splitlines() if line.startswith("FAILURE (seed"))
    check = found.split("): ", 1)[1].split(":")[0]  # what fired, e.g. PropertyViolation
    keys = redis.Redis.from_url(redis_url).keys(f"kvconform:{MUTANT}:universal:*")
    assert keys, "the failing example was not stored in Redis"

    second = run_campaign(
        engine=MUTANT,
        minutes=0.01,
        workers=1,
        seed=5000,
        failure_dir=str(tmp_path / "machine-b"),
        database=redis_url,
    )
    out_b = capsys.readouterr().out
    assert second == 1, out_b
    replayed = [line for line in out_b.splitlines() if "replayed from the example database" in line]
    assert replayed and f"): {check}:" in replayed[0], out_b
    assert list((tmp_path / "machine-b").glob("*.json")), "the replayed failure has no trace"


def test_unreachable_redis_is_refused_up_front(capsys) -> None:
    code = run_campaign(
        engine="reference", minutes=0.01, database=f"redis://127.0.0.1:{_free_port()}"
    )
    assert code == 2
    assert "cannot reach the Redis server" in capsys.readouterr().err
