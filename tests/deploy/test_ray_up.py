"""A real `ray up deploy/cluster.yaml` over SSH, against three mini-hosts on this machine.

Each mini-host (tests/deploy/netns/fleet_netns.sh) is its own network, PID, UTS and mount namespace
running its own sshd, on a private bridge (10.77.0.0/24): fleet-h0 is the head, fleet-h1/h2 the workers.
Besides the plain model, a sharded one spans two of the mini-hosts (deploy/serve-sharded.yaml's settings).
The test takes the real deploy/cluster.yaml and changes only what cannot be the same here:

- ``provider``: the mini-hosts' addresses instead of the Macs';
- ``auth``: root and the key generated for the mini-hosts;
- one ``file_mounts`` source: the fleet token the user makes with `make fleet-token`
  (deploy/.ray-token, gitignored) is a secret that must not be created or read in the checkout, so the
  mini-hosts' token is mounted in its place. The repo mount (``~/mlx-fleet: .``) is unchanged: `ray up`
  runs from the repo root, as users run it.

setup_commands stay as they are: each mini-host's ~/.bashrc (what a Mac's carries) puts this venv on
PATH and sets MLX_FLEET_SKIP_DEPS=1, so deploy/bootstrap/mac-setup.sh checks that venv instead of
building one with `make deps`. head_setup_commands start the fleet's Redis on the head as on a Mac.

Needs Linux, root (network namespaces, unshare), and iproute2, openssh-server, openssh-client, rsync
and redis-server; otherwise it skips, saying what is missing. About 60-90 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
FLEET_SH = Path(__file__).resolve().parent / "netns" / "fleet_netns.sh"
PREFIX = os.environ.get("FLEET_PREFIX", "fleet")
SUBNET = os.environ.get("FLEET_SUBNET", "10.77.0")
HOSTS = 3
NAMES = [f"{PREFIX}-h{i}" for i in range(HOSTS)]
IPS = [f"{SUBNET}.{10 + i}" for i in range(HOSTS)]
VENV = Path(sys.prefix)
RAY = VENV / "bin" / "ray"
NODES_TIMEOUT = 100  # s after `ray up` returns; workers need about 30-45 s on 2 cores

PROBE = """
import json, ray
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
nodes = [{"ip": n["NodeManagerAddress"], "host": n["NodeManagerHostname"],
          "mlx_fleet": n["Resources"].get("mlx_fleet", 0), "labels": n.get("Labels") or {}}
         for n in ray.nodes() if n["Alive"]]
print("FLEET_NODES " + json.dumps(nodes), flush=True)
"""


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "needs Linux (network namespaces)"
    if os.geteuid() != 0:
        return "needs root (ip netns, unshare --pid --mount)"
    if sys.prefix == sys.base_prefix or not RAY.exists():
        return f"needs to run from a venv with ray ({RAY} missing)"
    missing = [t for t in ("ip", "unshare", "mount", "ssh", "ssh-keygen", "rsync", "redis-server")
               if shutil.which(t) is None]
    if not os.access("/usr/sbin/sshd", os.X_OK):
        missing.append("/usr/sbin/sshd")
    if missing:
        return (f"missing {', '.join(missing)} "
                "(apt-get install -y iproute2 openssh-server openssh-client rsync redis-server)")
    probe_ns = f"{PREFIX}-probe{os.getpid()}"
    r = _run(["ip", "netns", "add", probe_ns])
    if r.returncode != 0:
        return f"`ip netns add` does not work here: {r.stderr.strip()}"
    try:
        r = _run(["ip", "netns", "exec", probe_ns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                  "--uts", "--mount", "--propagation", "private", "true"], timeout=20)
        if r.returncode != 0:
            return f"`unshare --pid --mount --uts` does not work here: {r.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe_ns])
    if _run(["ip", "link", "show", f"{PREFIX}-br0"]).returncode == 0:
        return f"{PREFIX}-br0 exists: another run is using prefix {PREFIX} (set FLEET_PREFIX/FLEET_SUBNET)"
    return None


def _pids_with(needle: str) -> list[str]:
    """Live (non-zombie) processes whose command line mentions needle."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or proc.name == str(os.getpid()):
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(x for x in (proc / "status").read_text().splitlines() if x.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if needle in cmdline and "(zombie)" not in state:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def _alive(pid: str) -> bool:
    try:
        return "(zombie)" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _ray_processes(namespaces: list[str]) -> list[str]:
    """Ray's processes (raylet, GCS, dashboard, workers, Serve) still running in the mini-hosts."""
    found = []
    for ns in namespaces:
        for pid in _run(["ip", "netns", "pids", ns]).stdout.split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if _alive(pid) and re.search(r"raylet|gcs_server|ray/dashboard|ray::|default_worker|log_monitor", cmdline):
                found.append(f"{ns} {pid}: {cmdline[:160]}")
    return found


def _netns_names() -> set[str]:
    return {line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()}


@pytest.fixture
def mini_hosts(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    fleet_dir = tmp_path / "fleet"
    env = {**os.environ, "FLEET_DIR": str(fleet_dir), "FLEET_VENV": str(VENV), "FLEET_PREFIX": PREFIX,
           "FLEET_SUBNET": SUBNET, "FLEET_HOSTS": str(HOSTS)}

    def fleet(cmd: str) -> subprocess.CompletedProcess:
        return _run(["bash", str(FLEET_SH), cmd], env=env, timeout=60)

    try:
        r = fleet("up")
        assert r.returncode == 0, f"fleet_netns.sh up failed:\n{r.stdout}\n{r.stderr}"
        yield fleet_dir, fleet
    finally:
        r = fleet("down")  # idempotent: the test tears down itself, this is for failures
        assert r.returncode == 0, f"fleet_netns.sh down failed:\n{r.stdout}\n{r.stderr}"


def _monitor_progress(head_tmp_ray: Path) -> tuple[int, list[str]]:
    """(active nodes in the head autoscaler's last status, failed worker launches) from its monitor.log."""
    logs = sorted(head_tmp_ray.glob("session_2*/logs/monitor.log"))
    if not logs:
        return 0, []
    text = logs[-1].read_text(errors="replace")
    blocks = re.findall(r"^Active:\n((?:[ \t]+\d+ \S+\n)*)", text, re.M)
    active = sum(int(n) for n in re.findall(r"^\s+(\d+) ", blocks[-1], re.M)) if blocks else 0
    return active, re.findall(r"^.*\(launch failed\).*$", text, re.M)


def _diagnostics(fleet_dir: Path) -> str:
    """The fatal lines of every mini-host's Ray logs and the head autoscaler's errors."""
    out = []
    for log in sorted(fleet_dir.glob("h*/tmpray/session_2*/logs/*")):
        if log.name in ("raylet.out", "raylet.err", "gcs_server.out", "monitor.out", "monitor.err") and log.is_file():
            bad = [x for x in log.read_text(errors="replace").splitlines()
                   if re.search(r"\] \(\w+\) .*(Check failed|FATAL)| C \d+ \d+\]|ERR |Error|Exception", x)]
            if bad:
                out.append(f"--- {log.relative_to(fleet_dir)}\n" + "\n".join(x[:400] for x in bad[-8:]))
    return "\n".join(out)


def _cluster_yaml(tmp_path: Path, fleet_dir: Path) -> Path:
    cfg = yaml.safe_load((REPO / "deploy" / "cluster.yaml").read_text())
    assert cfg["provider"]["type"] == "local"
    assert set(cfg["provider"]) == {"type", "head_ip", "worker_ips"}, "provider grew keys: check this test"
    cfg["provider"]["head_ip"] = IPS[0]
    cfg["provider"]["worker_ips"] = IPS[1:]
    cfg["auth"] = {"ssh_user": "root", "ssh_private_key": str(fleet_dir / "ssh" / "client_key")}
    # The fleet token: the mini-hosts' instead of the user's deploy/.ray-token (a gitignored secret
    # that `make fleet-token` writes; the test must neither create nor read it in the checkout).
    token_mounts = [k for k, v in cfg["file_mounts"].items() if str(v).endswith("deploy/.ray-token")]
    assert token_mounts == ["~/.ray/mlx-fleet-token"], cfg["file_mounts"]
    cfg["file_mounts"]["~/.ray/mlx-fleet-token"] = str(fleet_dir / "token")
    assert cfg["file_mounts"]["~/mlx-fleet"] == "."  # the repo itself: `ray up` runs from REPO
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _redis_url(ray_output: str) -> str:
    """The URL the head's start-redis.sh printed during `ray up` (head_setup_commands)."""
    found = re.findall(r"redis_url: (redis://\S+)", ray_output)
    assert found, f"start-redis.sh printed no redis_url:\n{ray_output[-3000:]}"
    return found[-1]


def _serve_yaml(tmp_path: Path, redis_url: str, routing: str = "round_robin", sharded: bool = False) -> Path:
    """deploy/serve.yaml with what only a user can fill in: the Redis URL `ray up` printed and a model
    (a built-in one: nothing to download). Two more changes, for this box: a small RAM budget, and
    first round-robin routing, so six requests in a row reach every mini-host whatever their loads.
    `sharded`: also a model each replica of which spans two mini-hosts, as deploy/serve-sharded.yaml's, in
    pipeline mode."""
    doc = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    args = doc["applications"][0]["args"]
    args["models"] = [{"name": "tiny-dense", "source": "tiny-dense"}]
    if sharded:
        sharded_model = yaml.safe_load((REPO / "deploy" / "serve-sharded.yaml").read_text())[
            "applications"][0]["args"]["models"][0]
        # pipeline here: tests/e2e/test_fleet_shards.py runs the file's tensor mode on a local fleet
        args["models"].append({**sharded_model, "name": "tiny-hybrid", "source": "tiny-hybrid", "shard_mode": "pipeline"})
    args["redis_url"] = redis_url
    args["cache"]["ram_bytes"] = 256 << 20
    args["routing"]["policy"] = routing
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_ray_up_brings_up_the_fleet_on_three_mini_hosts(tmp_path, mini_hosts):
    fleet_dir, fleet = mini_hosts
    cluster = _cluster_yaml(tmp_path, fleet_dir)
    probe = tmp_path / "probe_nodes.py"  # the head sees the same filesystem but for ~ and /tmp/ray
    probe.write_text(PROBE)
    client_tmp = tmp_path / "client-tmp"  # the "laptop"'s /tmp/ray/cluster-mlx-fleet.state and config caches
    client_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({
        "RAY_UP_enable_autoscaler_v2": "0",  # 2.60's v2 starts one worker too few with the local provider
        "RAY_USAGE_STATS_ENABLED": "0",
        "TMPDIR": str(client_tmp),
        "PATH": f"{VENV / 'bin'}:{os.environ.get('PATH', '')}",
    })
    log = tmp_path / "ray.log"

    def ray(*args: str, timeout: float) -> subprocess.CompletedProcess:
        r = _run([str(RAY), *args], cwd=REPO, env=env, timeout=timeout)
        with log.open("a") as f:
            f.write(f"\n$ ray {' '.join(args)}  (rc={r.returncode})\n{r.stdout}\n{r.stderr}\n")
        return r

    def tail() -> str:
        return log.read_text()[-6000:]

    netns_pids: set[str] = set()
    torn_down = False
    t0 = time.monotonic()
    try:
        r = ray("up", "-y", str(cluster), "--no-config-cache", timeout=150)
        assert r.returncode == 0, f"ray up failed:\n{tail()}"
        t_up = time.monotonic() - t0

        # Wait on the head's autoscaler log (read from the host dir, no CPU spent: every extra process
        # slows the workers' `ray start` on a small box), then ask the cluster itself, via `ray exec`.
        deadline = time.monotonic() + NODES_TIMEOUT
        nodes: list[dict] = []
        while time.monotonic() < deadline:
            active, failed = _monitor_progress(fleet_dir / "h0" / "tmpray")
            assert not failed, f"the autoscaler failed to start a worker: {failed}\n{_diagnostics(fleet_dir)}"
            if active >= HOSTS:
                r = ray("exec", str(cluster), "--no-config-cache", f"python {probe}", timeout=60)
                lines = [x for x in r.stdout.splitlines() if x.startswith("FLEET_NODES ")]
                nodes = json.loads(lines[-1].split(" ", 1)[1]) if lines else []
                if len(nodes) >= HOSTS:
                    break
            time.sleep(1)
        t_nodes = time.monotonic() - t0
        for ns in NAMES:
            netns_pids |= set(_run(["ip", "netns", "pids", ns]).stdout.split())

        assert sorted(n["ip"] for n in nodes) == IPS, \
            f"alive nodes {nodes} after {t_nodes:.0f} s:\n{tail()}\n{_diagnostics(fleet_dir)}"
        assert all(n["mlx_fleet"] == 1 for n in nodes), nodes
        # Each node is its own mini-host (UTS namespace) and its start command sourced fleet-env.sh.
        by_ip = {n["ip"]: n for n in nodes}
        for name, ip in zip(NAMES, IPS):
            assert by_ip[ip]["host"] == name, nodes
            assert by_ip[ip]["labels"].get("mlx-fleet/node") == name, nodes
        print(f"ray up returned after {t_up:.0f} s; {HOSTS} nodes alive after {t_nodes:.0f} s")

        # The app, deployed as users deploy it, then requests through the head's endpoint.
        redis_url = _redis_url(log.read_text())
        serve_file = _serve_yaml(tmp_path, redis_url)
        deploy_env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(fleet_dir / "token")}
        r = _run([str(VENV / "bin" / "mlx-fleet"), "deploy", str(serve_file), "--address",
                  f"http://{IPS[0]}:8265", "--timeout", "240"], cwd=REPO, env=deploy_env, timeout=300)
        assert r.returncode == 0, f"mlx-fleet deploy failed:\n{r.stdout}\n{r.stderr}\n{_diagnostics(fleet_dir)}"
        assert f"endpoint:  http://{IPS[0]}:8000/v1" in r.stdout, r.stdout
        served = []
        with httpx.Client(base_url=f"http://{IPS[0]}:8000", timeout=120, trust_env=False) as http:
            for i in range(2 * HOSTS):
                res = http.post("/v1/completions", json={"model": "tiny-dense", "prompt": f"across the bridge {i}",
                                                         "max_tokens": 2})
                assert res.status_code == 200, res.text
                served.append(res.headers["x-fleet-node"])
        assert {node.rsplit("-", 1)[0] for node in served} == set(NAMES), served  # every mini-host served
        print(f"deployed and served from every mini-host after {time.monotonic() - t0:.0f} s")

        # Cache affinity and migration across the bridge: the shipped routing again (an update of the
        # running app). A long prompt is asked once (cold), then six times at once: the router keeps what
        # it can on the node that holds the blocks and moves the rest (bounded load), and the nodes it
        # moves them to pull the blocks from the holder over the bridge instead of recomputing them.
        serve_file = _serve_yaml(tmp_path, redis_url, routing="affinity", sharded=True)
        r = _run([str(VENV / "bin" / "mlx-fleet"), "deploy", str(serve_file), "--address",
                  f"http://{IPS[0]}:8265", "--timeout", "240"], cwd=REPO, env=deploy_env, timeout=300)
        assert r.returncode == 0, f"mlx-fleet deploy (affinity) failed:\n{r.stdout}\n{r.stderr}"
        prompt = " ".join(f"word{i % 97}" for i in range(400))
        body = {"model": "tiny-dense", "prompt": prompt, "max_tokens": 4, "temperature": 0}

        def ask(http) -> tuple:
            res = http.post("/v1/completions", json=body)
            assert res.status_code == 200, res.text
            return (res.headers["x-fleet-node"], res.headers["x-fleet-route"],
                    res.json()["usage"]["prompt_tokens_details"]["cached_tokens"], res.json()["choices"][0]["text"])

        with httpx.Client(base_url=f"http://{IPS[0]}:8000", timeout=120, trust_env=False) as http:
            cold = ask(http)
            holder = cold[0]
            time.sleep(4)  # its blocks reach its disk and the index (what a peer can pull)
            with ThreadPoolExecutor(6) as pool:
                burst = list(pool.map(lambda _: ask(http), range(6)))
        assert cold[2] == 0 and all(b[2] > 0 for b in burst), (cold, burst)
        assert {b[3] for b in burst} == {cold[3]}, (cold, burst)  # a cached or pulled answer is the cold one
        assert any(b[0] == holder and "reason=hit" in b[1] for b in burst), burst
        # The others pull the holder's blocks (and a second request to a node that pulled them restores them
        # locally: a hot prefix replicates to where it is used).
        assert any(b[0] != holder and f"from={holder}" in b[1] and "fetched=0" not in b[1] for b in burst), burst
        print(f"affinity and migration across the bridge: {[b[1] for b in burst]} ({time.monotonic() - t0:.0f} s)")

        # The sharded model (deploy/serve-sharded.yaml's settings, pipeline mode): one replica over two mini-hosts,
        # half of the layers each, over MLX's ring across the bridge, its answer restored on both ranks the second time.
        body = {"model": "tiny-hybrid", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        with httpx.Client(base_url=f"http://{IPS[0]}:8000", timeout=120, trust_env=False) as http:
            sharded = [ask(http) for _ in range(2)]
        assert all(len({n.rsplit("-", 1)[0] for n in s[0].split(",")}) == 2 for s in sharded), sharded
        assert sharded[0][2] == 0 and sharded[1][2] > 0 and sharded[0][3] == sharded[1][3], sharded
        print(f"a sharded replica over {sharded[0][0]} ({time.monotonic() - t0:.0f} s)")

        # Tear down as deploy/README.md says: `ray down` stops the head; `ray stop` on each worker.
        r = ray("down", "-y", str(cluster), timeout=90)
        assert r.returncode == 0, f"ray down failed:\n{tail()}"
        for ip in IPS[1:]:
            r = _run(["ssh", "-i", str(fleet_dir / "ssh" / "client_key"), "-o", "StrictHostKeyChecking=no",
                      "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                      f"root@{ip}", 'bash -lc "source ~/.bashrc; ray stop"'], timeout=60)
            assert r.returncode == 0, f"ray stop on {ip} failed:\n{r.stdout}\n{r.stderr}"
        deadline = time.monotonic() + 20
        while (left := _ray_processes(NAMES)) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, f"Ray processes left on the mini-hosts after the documented teardown: {left}"
        torn_down = True
    finally:
        if not torn_down:
            ray("down", "-y", str(cluster), timeout=90)  # for a failure above (idempotent)
        for ns in NAMES:
            netns_pids |= set(_run(["ip", "netns", "pids", ns]).stdout.split())
        r = fleet("down")
        assert r.returncode == 0, f"fleet_netns.sh down failed:\n{r.stdout}\n{r.stderr}"

    # Nothing left: namespaces, links, processes of the mini-hosts, ssh masters to them.
    assert not (_netns_names() & set(NAMES))
    assert _run(["ip", "link", "show", f"{PREFIX}-br0"]).returncode != 0
    alive = [p for p in netns_pids if _alive(p)]
    assert not alive, f"processes of the mini-hosts still alive: {alive}"
    deadline = time.monotonic() + 20  # Ray's ssh ControlMasters persist 10 s after their last use
    while (left := _pids_with(str(fleet_dir))) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"processes still using the mini-hosts: {left}"
    print(f"whole cycle {time.monotonic() - t0:.0f} s")
