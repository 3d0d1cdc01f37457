"""`mlx-fleet loadtest`: one command from nothing to a report.

    mlx-fleet loadtest --routing affinity pow2 --duration 60s --out loadtest-out
    mlx-fleet loadtest --attach http://127.0.0.1:8000 --workload shared docqa --requests 200

For each routing policy, back to back and on equal terms (a fresh fleet each,
cold caches, the same seeded workload), or once against a fleet already running
(`--attach`):

    start the fleet (mlx-fleet up --routing P)  ─┐
    locust --headless (loadtest/locustfile.py)   │  out/<P>/locust_*.csv, report.html, records.jsonl
    the fleet's own numbers (mlx-fleet status)   │  out/<P>/fleet_status.json
    stop it (mlx-fleet down)                    ─┘
    → out/summary.json, out/ttft.png, out/throughput.png, out/reuse.png, and the ratios printed

It ends by itself (a duration, or a request count with a generous time cap),
letting the requests in flight at the end finish so that the records and the
fleet's own totals agree, and targets only loopback unless told otherwise
(`--allow-remote`).
Arguments after `--` go to locust as they are (workload sizes: `-- --doc-words 2000`).
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from loadtest.summary import ratios, read_records, summarize
from loadtest.workloads import WORKLOADS

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
POLICIES = ("affinity", "pow2", "round_robin")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-fleet loadtest", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attach", metavar="URL", help="use this running fleet instead of starting one")
    p.add_argument("--allow-remote", action="store_true", help="let --attach point at a non-loopback address")
    p.add_argument("--nodes", type=int, default=2, help="nodes of each fleet started (default 2)")
    p.add_argument("--model", default="tiny-dense", help="model of each fleet started (default tiny-dense)")
    p.add_argument("--fleet-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `mlx-fleet up` (repeat), e.g. --fleet-arg=--block-tokens --fleet-arg=32")
    p.add_argument("--routing", nargs="+", choices=POLICIES, default=["affinity"],
                   help="policies to run back to back, the first is the reference (default affinity)")
    p.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                   help="which workloads' users run (default all)")
    p.add_argument("--users", type=int, default=4,
                   help="concurrent users (default 4); locust gives each workload whole users, so with fewer users "
                        "than workloads some do not run")
    p.add_argument("--spawn-rate", type=float, default=2, help="users started per second (default 2)")
    p.add_argument("--duration", default="", help="run time per policy, e.g. 60s or 5m (default 60s)")
    p.add_argument("--requests", type=int, default=0, help="stop each run after this many requests instead")
    p.add_argument("--verify-fraction", type=float, default=0.1,
                   help="share of greedy answers replayed cold and compared (default 0.1)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                   help="API key, when the fleet requires one (default $OPENAI_API_KEY)")
    p.add_argument("--out", type=Path, default=Path("loadtest-out"), help="output folder (default ./loadtest-out)")
    p.add_argument("locust_args", nargs=argparse.REMAINDER, help="after --: passed to locust")
    return p


def check_target(url: str, allow_remote: bool) -> None:
    """Refuse to load anything but this machine unless asked: a load test is a flood."""
    host = urlparse(url).hostname
    if not host:
        raise ValueError(f"--attach {url!r} is not a URL; give one like http://127.0.0.1:8000")
    if allow_remote:
        return
    try:
        addresses = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise ValueError(f"--attach: cannot resolve {host!r} ({e})") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(f"--attach {url} is not a loopback address; add --allow-remote to load another machine")


def locust_command(a: argparse.Namespace, url: str, run_dir: Path) -> list[str]:
    duration = a.duration or ("" if a.requests else "60s")
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
           "-u", str(a.users), "-r", str(a.spawn_rate), "--host", url,
           "--csv", str(run_dir / "locust"), "--html", str(run_dir / "report.html"),
           "--records", str(run_dir / "records.jsonl"), "--verify-fraction", str(a.verify_fraction),
           "--tags", *a.workload]
    if a.requests:
        cmd += ["--max-requests", str(a.requests)]
    cmd += ["-t", duration or "2h"]  # a request count still gets a cap, so the run always ends
    # At the end (the time, or --requests), let every request in flight finish and be recorded, as the
    # fleet will serve and count it anyway: killed mid-request, a streamed answer or a cold replay would be
    # in the replicas' totals and missing from the records. Up to the per-request timeout; a later
    # --stop-timeout after `--` overrides it.
    cmd += ["--stop-timeout", "600"]
    return cmd + [x for x in a.locust_args if x != "--"]


def run_locust(a: argparse.Namespace, url: str, run_dir: Path) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "records.jsonl").unlink(missing_ok=True)
    env = {**os.environ, "OPENAI_API_KEY": a.api_key}  # in the environment, not on a command line ps shows
    with open(run_dir / "locust.log", "w") as log:
        return subprocess.run(locust_command(a, url, run_dir), env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def settled_status(fleet, timeout_s: float = 20.0) -> dict:
    """The fleet's status once its counters stop moving: replicas publish them every few seconds, so a
    status read the moment the load ends misses the last requests (and their pulled tokens)."""
    status = fleet.status()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(3)  # longer than the replicas' publishing period (2 s), so equal reads mean settled
        again = fleet.status()
        if again.get("fleet") == status.get("fleet"):
            return again
        status = again
    return status


def run_policy(a: argparse.Namespace, policy: Optional[str]) -> tuple[str, list[dict], Optional[dict]]:
    """One run; returns (label, records, the fleet's status at the end)."""
    label = policy or "attached"
    run_dir = a.out / label
    if a.attach:
        code, status = run_locust(a, a.attach, run_dir), None
    else:
        from cluster.fleet.spawned import SpawnedFleet

        extra = tuple(a.fleet_arg)
        print(f"[{label}] starting a {a.nodes}-node fleet of {a.model} ...", flush=True)
        with SpawnedFleet(a.out / f"fleet-{label}", a.nodes, (a.model,), policy, extra) as fleet:
            print(f"[{label}] load test at {fleet.url} ...", flush=True)
            code = run_locust(a, fleet.url, run_dir)
            status = settled_status(fleet)
        (run_dir / "fleet_status.json").write_text(json.dumps(status, indent=1))
    if code not in (0, 1):  # 1: locust saw failures, which the summary reports
        raise RuntimeError(f"locust exited with {code}; see {run_dir / 'locust.log'}")
    records = read_records(run_dir / "records.jsonl") if (run_dir / "records.jsonl").exists() else []
    if a.attach and records and records[0]["policy"]:  # name the run by the attached fleet's own policy
        label = records[0]["policy"]
        shutil.rmtree(a.out / label, ignore_errors=True)
        run_dir.rename(a.out / label)
    return label, records, status


def log_errors(path: Path, most: int = 3) -> str:
    """The last distinct error lines of a run's locust log: why nothing came back (a refused connection, a
    bad key), else its last lines."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = list(dict.fromkeys(line for line in lines if "ERROR" in line and line.rstrip()[-1:] != ":"))
    return "\n".join(errors[-most:] or lines[-most:])


def report(summary: dict) -> str:
    lines = [f"{'run':<12} {'reqs':>5} {'fail':>4} {'5xx':>4} {'wrong':>5} {'reuse':>6} {'TTFT p50':>9} "
             f"{'p90':>7} {'full p50':>9} {'cold p50':>9} {'req/s':>6}"]
    for name, s in summary["runs"].items():
        by = s["ttft_s_by_cache_state"]
        lines.append(f"{name:<12} {s['requests']:>5} {s['failures']:>4} {s['status_5xx']:>4} {s['wrong_answers']:>5} "
                     f"{s['reuse_ratio']:>6.2f} {_s(s['ttft_s'].get('p50')):>9} {_s(s['ttft_s'].get('p90')):>7} "
                     f"{_s(by['full'].get('p50')):>9} {_s(by['cold'].get('p50')):>9} {s['throughput_rps']:>6.2f}")
    for pair, r in summary["ratios"].items():
        lines.append(f"{pair}: TTFT p50 x{r['ttft_p50']}, p90 x{r['ttft_p90']}, throughput x{r['throughput']}, "
                     f"reuse x{r['reuse_ratio']}")
    return "\n".join(lines)


def _s(v: Optional[float]) -> str:
    return f"{v:.3f}s" if v is not None else "-"


FLEET_ONLY = ("nodes", "model", "fleet_arg", "routing")  # what shapes a fleet the runner starts, not one attached


def ignored_with_attach(a: argparse.Namespace) -> list[str]:
    """The options given that only shape fleets the runner starts (--routing has its own check)."""
    defaults = parser().parse_args([])
    return [f"--{k.replace('_', '-')}" for k in FLEET_ONLY if k != "routing" and getattr(a, k) != getattr(defaults, k)]


def args_record(a: argparse.Namespace) -> dict:
    """The run's settings for summary.json, as JSON values; never the API key, and with --attach none of the
    settings of fleets it did not start."""
    skip = {"api_key", *(FLEET_ONLY if a.attach else ())}
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k not in skip}


def main(argv: Optional[list[str]] = None) -> int:
    a = parser().parse_args(argv)
    if a.attach:
        if len(a.routing) > 1:
            raise SystemExit("--attach runs the attached fleet's own policy; give one --routing, or none")
        try:
            check_target(a.attach, a.allow_remote)
        except ValueError as e:
            raise SystemExit(str(e))
        ignored = ignored_with_attach(a)
        if ignored:
            print(f"note: {', '.join(ignored)} shape(s) the fleets the runner starts; with --attach they are ignored",
                  file=sys.stderr)

    if importlib.util.find_spec("locust") is None:
        raise SystemExit("locust is not installed in this environment: run `make deps` "
                         "(or pip install 'mlx-fleet[load]')")
    if a.users < len(a.workload):
        print(f"note: {a.users} users for {len(a.workload)} workloads: locust runs whole users, so "
              f"{len(a.workload) - a.users} workload(s) get none; pass --users {len(a.workload)} or fewer --workload",
              file=sys.stderr)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    runs: dict[str, list[dict]] = {}
    summary: dict = {"started": t0, "args": args_record(a), "runs": {}}
    for policy in ([None] if a.attach else a.routing):
        label, records, status = run_policy(a, policy)
        if not records:  # nothing to summarize is a failed run, not an empty success
            raise SystemExit(f"[{label}] no request completed; from {a.out / label / 'locust.log'}:\n"
                             + log_errors(a.out / label / "locust.log"))
        runs[label] = records
        summary["runs"][label] = summarize(records)
        idle = sorted(set(a.workload) - set(summary["runs"][label]["ttft_s_by_workload"]))
        if idle:
            print(f"note: [{label}] no request of workload(s) {', '.join(idle)} completed", file=sys.stderr)
        if status is not None:
            summary["runs"][label]["fleet"] = status.get("fleet", {})
    summary["ratios"] = ratios(summary["runs"])
    from loadtest.plots import write_plots

    summary["plots"] = [p.name for p in write_plots(runs, a.out)]
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(report(summary))
    print(f"wrote {', '.join([f'{a.out}/summary.json', *summary['plots']])}, and per run: locust_*.csv, report.html")
    bad = {n: (s["status_5xx"], s["wrong_answers"]) for n, s in summary["runs"].items()
           if s["status_5xx"] or s["wrong_answers"]}
    if bad:
        print(f"FAILED: 5xx responses or wrong answers (5xx, wrong) per run: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
