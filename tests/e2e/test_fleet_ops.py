"""Operating a fleet: one `up` per data dir, nodes that share a host name, API keys, a Redis that dies."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.local_fleet import LocalFleet

pytestmark = pytest.mark.fleet
MODEL = "tiny-dense"
FILE_KEY = "file-key-0123456789abcdef"
ENV_KEY = "env-key-0123456789abcdef"
HELLO = [{"role": "user", "content": "Hello, operator!"}]


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    """Two `up`s at once on one data dir: exactly one fleet starts. Its nodes all call themselves 'studio'."""
    base = tmp_path_factory.mktemp("ops")
    keys = base / "keys.txt"
    keys.write_text(f"# the fleet's API keys\n{FILE_KEY}\n")
    fleet = LocalFleet(base / "data", nodes=2, extra=("--api-keys-file", str(keys)),
                       env={"MLX_FLEET_NODE_NAME": "studio", "MLX_FLEET_API_KEYS": ENV_KEY})
    env = {**os.environ, **fleet.env}
    argv = [sys.executable, "-m", "cluster.cli", *fleet.up_args(), "--data-dir", str(fleet.data_dir)]
    started = time.monotonic()
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    results = [None, None]

    def finish(i):
        out, err = procs[i].communicate(timeout=600)
        results[i] = (procs[i].returncode, out, err, time.monotonic() - started)

    waiters = [threading.Thread(target=finish, args=(i,)) for i in range(2)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    try:
        yield fleet, results
    finally:
        fleet.down()
    assert fleet.processes() == []


@pytest.fixture(scope="module")
def headers():
    return {"Authorization": f"Bearer {FILE_KEY}"}


def test_a_second_up_on_the_same_data_dir_fails_at_once(ops):
    fleet, results = ops
    codes = sorted(r[0] for r in results)
    assert codes == [0, 1], results
    loser = next(r for r in results if r[0] == 1)
    assert "already running or starting" in loser[2] and "mlx-fleet down" in loser[2]
    assert loser[3] < 30  # it did not wait for the other to finish
    assert fleet.status()["models"][0]["replicas"] == 2


def test_nodes_sharing_a_host_name_keep_their_own_identity(ops, headers):
    fleet, _ = ops
    with httpx.Client(base_url=fleet.url, timeout=60, headers=headers) as http:
        served = set()
        for i in range(30):
            # A new prompt each time: nobody holds it, so it goes to the node used least lately, and the two
            # nodes take turns. (The same prompt again goes to its holder; it reached the other node only when
            # a lease a flush old made the holder look busy.)
            prompt = f"Mac number {i}: " + " ".join(["Every Mac here is called studio."] * 30)
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200
            served.add(r.headers["x-fleet-node"])
            if len(served) == 2:
                break
    status = fleet.status()
    nodes = status["nodes"]
    assert [n["name"] for n in nodes] == ["studio", "studio"]
    ids = {n["node_id"] for n in nodes}
    assert len(ids) == 2 and served == ids and all(i.startswith("studio-") for i in ids)
    for n in nodes:  # each has its own store, with its own blocks, and refused none of them
        assert n["disk"]["node_id"] == n["node_id"] and sum(n["disk"]["quarantined"].values()) == 0
    for name in ("node-0", "node-1"):
        assert (fleet.data_dir / name / "node-id").read_text().strip() in ids


def test_api_keys_are_required_everywhere_but_health(ops):
    fleet, _ = ops
    with httpx.Client(base_url=fleet.url, timeout=60) as http:
        for path in ("/v1/models", "/v1/fleet/status", "/openapi.json"):
            r = http.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong-key-0123456789"}).status_code == 401
        assert http.get("/v1/models", headers={"Authorization": FILE_KEY}).status_code == 401  # no scheme
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert http.get("/health").status_code == 200
        for key in (FILE_KEY, ENV_KEY):
            assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_the_openai_sdk_sends_its_api_key(ops):
    fleet, _ = ops
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=FILE_KEY, max_retries=0, timeout=60)
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4).choices[0].message.content
    bad = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="not-a-key-0123456789", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def locust_with_key(fleet, key: str, out: Path) -> tuple[int, list[dict]]:
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "2",
                        "-r", "2", "-t", "6s", "--host", fleet.url, "--csv", str(out), "--tags", "unique",
                        "--unique-words", "40"],  # short prompts: several answers within the 6 s on a slow box
                       capture_output=True, text=True, timeout=300, cwd=root, env={**os.environ, "OPENAI_API_KEY": key})
    with open(f"{out}_stats.csv", newline="") as f:
        return r.returncode, [row for row in csv.DictReader(f) if row["Name"] != "Aggregated"]


def test_the_load_test_sends_the_api_key(ops, tmp_path):
    fleet, _ = ops
    code, rows = locust_with_key(fleet, FILE_KEY, tmp_path / "keyed")
    assert code == 0 and all(row["Failure Count"] == "0" for row in rows)
    assert {row["Type"] for row in rows} >= {"GET", "POST", "TTFT"}
    code, rows = locust_with_key(fleet, "not-a-key-0123456789", tmp_path / "unkeyed")  # refused, and said so
    assert code == 1 and [(row["Type"], row["Name"]) for row in rows] == [("GET", "/v1/models")]
    assert int(rows[0]["Failure Count"]) >= 1


def redis_pid(fleet) -> int:
    return json.loads((fleet.data_dir / "supervisor.json").read_text())["redis"]["pid"]


def test_status_without_redis_still_reports_the_replicas_from_serve(ops, headers):
    fleet, _ = ops
    pid = redis_pid(fleet)
    os.kill(pid, signal.SIGSTOP)  # a Redis that does not answer
    try:
        status = fleet.status()
        assert status["redis"]["reachable"] is False and status["redis"]["error"]
        assert status["replicas_source"] == "serve"
        assert status["models"] == [{"name": MODEL, "replicas": 2, "nodes": None}]
        assert "UNREACHABLE" in fleet.cli("status").stdout
        r = httpx.post(f"{fleet.url}/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2},
                       headers=headers, timeout=60)
        assert r.status_code == 200  # serving goes on
        health = httpx.get(f"{fleet.url}/health", timeout=30)
        assert health.status_code == 200 and health.json()["models"] == {MODEL: True}  # Serve says so
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_dead_redis_is_restarted_logged_and_counted(ops, headers):
    """Health stays 200 throughout: while Redis is down (Serve's view), and while the new, empty Redis waits
    for the replicas to renew their leases (a new user saw 503s then, with requests served all along)."""
    fleet, _ = ops
    pid = redis_pid(fleet)
    os.kill(pid, signal.SIGKILL)
    deadline, health = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        known = json.loads((fleet.data_dir / "supervisor.json").read_text())["redis"]
        if known["pid"] != pid and known["running"]:
            break
        health.append(httpx.get(f"{fleet.url}/health", timeout=30).status_code)
        time.sleep(0.1)
    assert known["restarts"] == 1 and known["last_restart"]
    assert "restarting it (restart #1)" in (fleet.data_dir / "logs" / "supervisor.log").read_text()
    deadline = time.monotonic() + 30  # replicas renew their leases in the new Redis
    while True:
        status = fleet.status()
        if status["replicas_source"] == "leases" and len(status["replicas"]) == 2 or time.monotonic() > deadline:
            break
        health.append(httpx.get(f"{fleet.url}/health", timeout=30).status_code)
        time.sleep(0.1)
    assert health and set(health) == {200}, health
    assert status["redis"]["reachable"] and status["redis"]["restarts"] == 1 and len(status["replicas"]) == 2
    assert status["redis"]["supervisor_running"] is True
    r = httpx.post(f"{fleet.url}/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2},
                   headers=headers, timeout=60)
    assert r.status_code == 200
