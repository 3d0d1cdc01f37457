"""The GPU run: every in-process suite and the cache and batching benchmarks on a real GPU, in one command.

    python3 -m cluster.cli bench gpu [--out DIR] [--parts tests,ttft,batch,agreement]
                                     [--suites "tests/engine;tests/families,tests/kernels;..."]
                                     [--ttft-models ...]
                                     [--tokens 2048 8192 32768] [--resume-at chunk block]
                                     [--batch-model bench-qwen3-8b] [--concurrency 1 4 8 16 32]
                                     [--agreement-model bench-qwen3-0.6b-bf16] [--agreement-prompts 200]

Run from the repository root on a machine whose MLX has a GPU backend (MLX's CUDA
backend on Linux, Metal on a Mac). It needs no Ray, Redis or network:
- tests: the suites that run in one process (engine, families, kvcache, store,
  models), with the thread guard on, where a lazy array used on another thread
  fails for real, as on Metal;
- ttft:  `bench ttft` (cold, capture, RAM and disk hits) on realistic bf16 geometries, with
         mlx_lm.server's prompt cache on the same models as the peer (`--vs-mlx-lm-server`);
- batch: `bench batch --no-http` (ours against mlx-lm's BatchGenerator) on one;
- agreement: `bench agreement` (batched greedy answers against the same requests alone).
Logs and JSON go to --out (default $OUT, else ./gpu-run); summary.json says what
passed. The tests log names each test as it ends (pytest -v), so a part cut by its
timeout still says which failed. The suites go in groups (`;` between groups, `,`
within one), one pytest process per group, all at once: a GPU and 16 cores run the
three default groups side by side in about 250 s where one process took over 545 s
(an H100), inside the lent machine's 10 minutes a command; each group logs to
tests-<k>.log. docs/gpu.md records each run. CI never runs this: it is not part of make test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster.bench.common import environment, parser

# In groups of about equal time on a GPU (an H100: 244, 119 and 186 s), one pytest process each, run at once.
SUITES = "tests/engine;tests/families,tests/kernels;tests/kvcache,tests/store,tests/models"
# In those folders, the modules that need a Redis server (none on the GPU machine).
NEEDS_REDIS = ["tests/store/test_fleet_index.py", "tests/kvcache/test_fleet_index_e2e.py", "tests/store/test_redis_client.py"]
TTFT_MODELS = "bench-qwen3-8b,bench-qwen3-0.6b-bf16,bench-hybrid-8b,bench-gemma3-4b"


def run_part(name: str, argv: list[str], out: Path, timeout_s: float) -> dict:
    """Run one part as a child process, its output to out/<name>.log; what it returned and took."""
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    how = "timed out" if rc == "timeout" else f"killed by {_signal_name(-rc)}" if rc < 0 else f"exit {rc}"
    print(f"gpu run: {name}: {how} in {time.monotonic() - t0:.0f} s", flush=True)
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1)}


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} (signal {number})"
    except ValueError:
        return f"signal {number}"


RESULTS = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "error", "XFAIL": "xfailed",
           "XPASS": "xpassed"}


def test_counts(log: Path) -> dict:
    """pytest's final counts ("3 failed, 410 passed, 2 skipped in 95.1s") and the failed tests' ids.

    A run cut short (its timeout, or its process killed: an abort in MLX's CUDA backend ends it with no
    summary) has no final line: then the counts are those of the tests that ended (-v names each), and
    `running` is the test that was running when it was cut, the first place to look."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    tail = text.rsplit("\n=", 1)[-1]
    if re.search(r"\bin [\d.]+s\b", tail):  # the final line: "=== 3 failed, 410 passed in 95.1s (0:01:35) ==="
        counts: dict = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", tail)}
    else:
        counts = {}
        for word in re.findall(rf"^\S+::\S+ ({'|'.join(RESULTS)})\b", text, re.M):
            counts[RESULTS[word]] = counts.get(RESULTS[word], 0) + 1
        started = re.findall(r"^(\S+::\S+)(?: (\w+))?", text, re.M)
        if started and started[-1][1] not in RESULTS:
            counts["running"] = started[-1][0]
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M))
                    | set(re.findall(r"^(\S+::\S+) (?:FAILED|ERROR)", text, re.M)))  # -v: as each ends
    return {**counts, "failed_tests": failed}


def merged(groups: list[dict]) -> dict:
    """One summary of the groups' runs: counts added, failures together, the first bad exit (or a timeout);
    each group's own summary under "groups"."""
    out: dict = {"rc": next((g["rc"] for g in groups if g["rc"] != 0), 0),
                 "seconds": max(g["seconds"] for g in groups)}
    for g in groups:
        for k, v in g.items():
            if k not in ("rc", "seconds", "suites", "failed_tests", "running"):
                out[k] = out.get(k, 0) + v
    out["failed_tests"] = sorted({t for g in groups for t in g["failed_tests"]})
    if any("running" in g for g in groups):  # groups cut short: what each was running then
        out["running_when_cut"] = [g["running"] for g in groups if "running" in g]
    out["groups"] = groups
    return out


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-run"), help="logs and JSON")
    p.add_argument("--parts", default="tests,ttft,batch,agreement", help="which parts, comma-separated")
    p.add_argument("--ttft-models", default=TTFT_MODELS, help="built-in models for bench ttft")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768], help="bench ttft prompt lengths")
    p.add_argument("--resume-at", nargs="+", default=["chunk", "block"], choices=["auto", "chunk", "block"],
                   help="bench ttft's prefill schedules (one row each)")
    p.add_argument("--batch-model", default="bench-qwen3-8b", help="the model of bench batch")
    p.add_argument("--agreement-model", default="bench-qwen3-0.6b-bf16", help="the model of bench agreement")
    p.add_argument("--agreement-prompts", type=int, default=200, help="bench agreement's prompts")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32], help="bench batch levels")
    p.add_argument("--timeout", type=float, default=3600, help="seconds each part may take")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments for the tests part")
    p.add_argument("--suites", default=SUITES,
                   help="the tests part's folders: groups separated by ';', run at once, folders within one by ','")
    a = p.parse_args(argv)
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu:
        print("bench gpu: MLX's default device here is the CPU; this run is for a GPU backend "
              "(pip install 'mlx-fleet[cuda]' on Linux with CUDA 13, or a Mac)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    parts, summary = a.parts.split(","), {"environment": environment(), "device_info": _device_info(),
                                          "commit": _commit()}
    py = sys.executable
    bench = [py, "-m", "cluster.cli", "bench"]
    data = ["--data-dir", str(a.data_dir)]
    if "tests" in parts:
        groups = [g.split(",") for g in a.suites.split(";") if g.strip()]
        names = ["tests"] if len(groups) == 1 else [f"tests-{k + 1}" for k in range(len(groups))]

        def run_group(name: str, suites: list[str]) -> dict:
            argv = [py, "-m", "pytest", *suites, *(f"--ignore={m}" for m in NEEDS_REDIS), "-v",
                    "-p", "no:cacheprovider", *a.pytest_args.split()]
            return {"suites": suites, **run_part(name, argv, a.out, a.timeout), **test_counts(a.out / f"{name}.log")}

        with ThreadPoolExecutor(len(groups)) as pool:
            summary["tests"] = merged(list(pool.map(run_group, names, groups)))
    if "ttft" in parts:
        argv = [*bench, "ttft", *data, "--models", a.ttft_models, "--tokens", *map(str, a.tokens),
                "--resume-at", *a.resume_at, "--vs-mlx-lm-server", "--json", str(a.out / "ttft.json")]
        summary["ttft"] = run_part("ttft", argv, a.out, a.timeout)
    if "batch" in parts:
        argv = [*bench, "batch", *data, "--no-http", "--no-sequential", "--deterministic", "--model", a.batch_model,
                "--prompt-tokens", "128",
                "--rounds", "3", "--concurrency", *map(str, a.concurrency), "--json", str(a.out / "batch.json")]
        summary["batch"] = run_part("batch", argv, a.out, a.timeout)
    if "agreement" in parts:
        argv = [*bench, "agreement", *data, "--model", a.agreement_model, "--prompts", str(a.agreement_prompts),
                "--json", str(a.out / "agreement.json")]
        summary["agreement"] = run_part("agreement", argv, a.out, a.timeout)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("environment", "device_info")}, indent=2))
    ok = all(summary[k]["rc"] == 0 for k in ("tests", "ttft", "batch", "agreement") if k in summary)
    return 0 if ok else 1


def _device_info() -> dict:
    import mlx.core as mx

    try:
        return {k: v if isinstance(v, (int, float, str)) else str(v) for k, v in mx.device_info().items()}
    except Exception as e:  # an older build: say so rather than fail the run
        return {"error": f"{type(e).__name__}: {e}"}


def _commit() -> str:
    if os.environ.get("MLX_FLEET_COMMIT"):
        return os.environ["MLX_FLEET_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
