"""Load tests against real fleets: plain locust, the runner attached, and the runner comparing two policies."""

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from loadtest.run import args_record, check_target, ignored_with_attach, parser
from loadtest.summary import read_records
from tests.local_fleet import LocalFleet

pytestmark = pytest.mark.fleet
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with LocalFleet(tmp_path_factory.mktemp("loadtest-fleet"), nodes=2) as f:
        yield f
    assert f.processes() == []


def served_tokens(fleet) -> tuple[int, int]:
    """(prompt, cached) tokens the fleet's replicas have counted so far."""
    replicas = fleet.status()["replicas"]
    return sum(r.get("prompt_tokens", 0) for r in replicas), sum(r.get("cached_tokens", 0) for r in replicas)


def settled_tokens(fleet, before: tuple[int, int], expect_prompt: int, timeout_s: float = 30.0) -> tuple[int, int]:
    """The replicas' counters once they have caught up with what the clients saw (their stats are periodic)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = served_tokens(fleet)
        delta = (now[0] - before[0], now[1] - before[1])
        if delta[0] >= expect_prompt or time.monotonic() > deadline:
            return delta
        time.sleep(1)


def quiet_tokens(fleet, timeout_s: float = 30.0) -> tuple[int, int]:
    """The counters once they stop moving: replicas report them every few seconds, so requests that ended
    just before (the previous test's last ones) may not be in them yet."""
    deadline = time.monotonic() + timeout_s
    last = served_tokens(fleet)
    while time.monotonic() < deadline:
        time.sleep(3)
        now = served_tokens(fleet)
        if now == last:
            return now
        last = now
    return last


def stats_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def loadtest(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", "loadtest", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_plain_locust_needs_only_a_host(fleet, tmp_path):
    # --stop-timeout lets each user finish the request it has in flight at the 12 s mark: on a slow box the
    # first answers to the default (long) prompts can take longer than the run, and an interrupted request
    # is never counted.
    r = subprocess.run([sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "4", "-r",
                        "2", "-t", "12s", "--stop-timeout", "120", "--host", fleet.url, "--csv", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = stats_rows(tmp_path / "out_stats.csv")
    posts = [x for x in rows if x["Type"] == "POST"]
    assert posts and all(x["Failure Count"] == "0" for x in posts), posts
    assert {x["Name"] for x in rows if x["Type"] == "TTFT"} <= {"cold", "partial", "full"}
    assert any(x["Type"] == "TTFT" for x in rows)


def test_the_runner_attached_reports_exact_totals_splits_and_files(fleet, tmp_path):
    out = tmp_path / "run"
    before = quiet_tokens(fleet)
    # Its own seed: the plain locust run above (seed 0) has cached its prompts, and first turns must be cold.
    r = loadtest("--attach", fleet.url, "--users", "4", "--spawn-rate", "4", "--requests", "16",
                 "--verify-fraction", "0.3", "--out", str(out), "--", "--workload-seed", "7")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["runs"]) == ["affinity"]  # the attached fleet's policy, from x-fleet-route
    assert (summary["args"]["attach"], summary["args"]["users"], summary["args"]["out"]) == (fleet.url, 4, str(out))
    assert "nodes" not in summary["args"] and "api_key" not in summary["args"]
    if len(summary["runs"]["affinity"]["ttft_s_by_workload"]) < 5:  # 4 users, 5 workloads: locust's pick
        assert "no request of workload(s)" in r.stderr
    run = summary["runs"]["affinity"]
    assert run["requests"] >= 16 and run["failures"] == 0 and run["status_5xx"] == 0
    # 0.3 of the greedy answers, evenly: the 4th, 7th, 10th, 14th (the last may be cut off by the stop)
    assert run["wrong_answers"] == 0 and run["replays"]["count"] >= 3 and run["replays"]["failed"] == 0
    assert set(run["ttft_s_by_cache_state"]) == {"cold", "partial", "full"}
    assert run["cache_states"]["cold"] > 0 and run["cache_states"]["full"] + run["cache_states"]["partial"] > 0
    assert sum(run["cache_states"].values()) == run["requests"]

    records = read_records(out / "affinity" / "records.jsonl")
    asked = [x for x in records if x["kind"] == "request"]
    assert run["tokens"]["cached"] == sum(x["cached_tokens"] for x in asked)
    assert run["tokens"]["prompt"] == sum(x["prompt_tokens"] for x in asked)
    # ... and equal to what the replicas themselves counted (replays are cold, so add no cached tokens).
    replay_prompt = sum(x["prompt_tokens"] for x in records if x["kind"] == "verify")
    prompt, cached = settled_tokens(fleet, before, run["tokens"]["prompt"] + replay_prompt)
    assert (prompt, cached) == (run["tokens"]["prompt"] + replay_prompt, run["tokens"]["cached"])

    for name in ("locust_stats.csv", "locust_stats_history.csv", "report.html", "locust.log"):
        assert (out / "affinity" / name).stat().st_size > 0, name
    assert {x["Type"] for x in stats_rows(out / "affinity" / "locust_stats.csv")} >= {"POST", "TTFT", "ITL", "VERIFY"}
    assert summary["plots"] == ["ttft.png", "throughput.png", "reuse.png"]
    for png in summary["plots"]:
        with Image.open(out / png) as im:
            assert im.format == "PNG" and im.width > 400
            assert len(im.convert("RGB").getcolors(maxcolors=1 << 16) or range(99)) > 20


def test_fleet_settings_given_with_attach_are_named_as_ignored():
    given = parser().parse_args(["--attach", "http://127.0.0.1:8000", "--model", "tiny-swa", "--nodes", "3"])
    assert ignored_with_attach(given) == ["--nodes", "--model"]
    assert ignored_with_attach(parser().parse_args(["--attach", "http://127.0.0.1:8000", "--users", "9"])) == []


def test_the_summary_records_settings_as_json_values_never_the_key():
    a = parser().parse_args(["--routing", "affinity", "pow2", "--users", "5", "--api-key", "sk-secret"])
    rec = args_record(a)
    assert (rec["routing"], rec["users"], rec["nodes"], rec["allow_remote"], rec["out"]) == (
        ["affinity", "pow2"], 5, 2, False, "loadtest-out")
    assert "api_key" not in rec and "sk-secret" not in json.dumps(rec)
    attached = args_record(parser().parse_args(["--attach", "http://127.0.0.1:8000"]))
    assert attached["attach"] == "http://127.0.0.1:8000"
    assert not {"nodes", "model", "fleet_arg", "routing"} & set(attached)  # the attached fleet's, not ours


def test_the_runner_compares_policies_on_fresh_fleets_and_stops_them(tmp_path):
    out = tmp_path / "compare"
    r = loadtest("--routing", "affinity", "pow2", "--nodes", "1", "--workload", "shared", "--users", "3",
                 "--spawn-rate", "3", "--requests", "6", "--verify-fraction", "0", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["runs"]) == ["affinity", "pow2"]
    assert list(summary["ratios"]) == ["pow2/affinity"]
    for name, run in summary["runs"].items():
        assert run["requests"] >= 6 and run["failures"] == 0, name
        assert set(run["ttft_s_by_workload"]) == {"shared"}
        assert run["fleet"]["reuse"] is not None  # the fleet's own numbers, taken before it stopped
    assert "pow2/affinity: TTFT p50 x" in r.stdout
    for label in ("affinity", "pow2"):
        assert LocalFleet(out / f"fleet-{label}").processes() == []


def test_the_runner_fails_when_no_request_completed(tmp_path):
    from cluster.ports import free_port

    out = tmp_path / "run"
    r = loadtest("--attach", f"http://127.0.0.1:{free_port()}", "--users", "1", "--duration", "3s", "--out", str(out))
    assert r.returncode == 1 and "[attached] no request completed" in r.stderr, r.stdout + r.stderr[-3000:]
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("url,ok", [("http://127.0.0.1:8000", True), ("http://localhost:1", True),
                                    ("http://[::1]:8000", True), ("http://10.1.2.3:8000", False),
                                    ("not a url", False)])
def test_the_runner_loads_only_loopback_unless_told(url, ok):
    if ok:
        check_target(url, allow_remote=False)
    else:
        with pytest.raises(ValueError):
            check_target(url, allow_remote=False)
    check_target("http://10.1.2.3:8000", allow_remote=True)  # allowed, and nothing is sent here
