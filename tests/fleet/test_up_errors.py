"""A failing `mlx-fleet up` says what is wrong in one line, exits non-zero, and leaves nothing running."""

import socket
import subprocess
import sys

import pytest

from cluster.ports import free_port
from cluster.fleet.processes import tagged
from cluster.fleet.state import fleet_tag


def up(data_dir, *args):
    if "--port" not in args:
        args = (*args, "--port", str(free_port()))
    return subprocess.run([sys.executable, "-m", "cluster.cli", "up", "--data-dir", str(data_dir), "--no-dashboard", *args],
                          capture_output=True, text=True, timeout=120)


def assert_clean_failure(result, data_dir, *phrases):
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in lines[0]
    assert tagged(fleet_tag(data_dir)) == []


def test_bad_model_path(tmp_path):
    r = up(tmp_path, "--model", str(tmp_path / "missing-model"))
    assert_clean_failure(r, tmp_path, "missing-model", "not an existing directory")


def test_port_taken(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = up(tmp_path, "--port", str(port))
    assert_clean_failure(r, tmp_path, f"port {port}", "already in use", "--port")


def test_a_bad_model_is_named_before_a_taken_port(tmp_path):
    """Both wrong: the model is said first, so the next try does not fail on it after the port is freed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = up(tmp_path, "--port", str(s.getsockname()[1]), "--model", "tiny-dens")
    assert_clean_failure(r, tmp_path, "'tiny-dens' is not a built-in model", "did you mean tiny-dense?")
    assert "starting" not in r.stdout  # nothing was


def test_an_address_this_machine_lacks_is_not_called_a_port_in_use(tmp_path):
    r = up(tmp_path, "--host", "192.0.2.1")  # TEST-NET-1: never a local address; binding it sends nothing
    assert_clean_failure(r, tmp_path, "cannot listen on 192.0.2.1:", "address", "--host")
    assert "already in use" not in r.stderr


def test_unreachable_redis(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, never listening: connections are refused
        r = up(tmp_path, "--redis-url", f"redis://127.0.0.1:{dead}/0")
    assert_clean_failure(r, tmp_path, "cannot reach Redis", "--redis-url")


@pytest.mark.parametrize("args,line", [
    (["--nodes", "0"], "mlx-fleet: --nodes: Input should be greater than or equal to 1"),
    (["--block-tokens", "7"], "mlx-fleet: --block-tokens (16-256, default 64): Input should be greater than or equal to 16"),
    (["--cache-ram-gb", "-1"], "mlx-fleet: --cache-ram-gb: Input should be greater than or equal to 0"),
    (["--gateways", "0"], "mlx-fleet: --gateways: Input should be greater than or equal to 1"),
    (["--redis-url", "http://127.0.0.1:6379"], "mlx-fleet: --redis-url: a Redis URL starts with redis://"),
    (["--shards", "2"], "mlx-fleet: --shards: each replica spans 2 nodes, and the fleet has 1; start at least as many "
                        "(--nodes 2), or shard less"),
    (["--nodes", "2", "--shards", "2", "--model", "tiny-dense", "--model", "b=tiny-dense"],
     "mlx-fleet: --shards: the sharded replicas need 4 nodes, one rank per node (replicas x shards: tiny-dense 1 x 2, "
     "b 1 x 2), and the fleet has 2; start more nodes (--nodes 4), lower num_replicas, or shard fewer models"),
])
def test_config_errors_name_the_field(tmp_path, args, line):
    r = up(tmp_path, *args)
    assert r.returncode == 2
    assert r.stderr.startswith(line)


def test_a_model_mlx_lm_cannot_split_is_refused_before_any_node_starts(tmp_path):
    r = up(tmp_path, "--nodes", "2", "--shards", "2", "--model", "tiny-swa")
    assert_clean_failure(r, tmp_path, "model tiny-swa: shards: 2: mlx-lm cannot split 'gemma3_text' models in either "
                                      "mode; tensor parallel can split")
    assert "supervisor" not in r.stdout  # refused right after the model was found, before Redis and Ray


def test_a_failed_deployment_says_its_error_first():
    from cluster.fleet.launcher import deploy_failure

    traceback = ("The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n"
                 + "  File \"x.py\", line 1, in f\n" * 200 + "UnshardableModel: shards: 2: mlx-lm cannot split it\n")
    assert deploy_failure([traceback, "", "Gateway: no healthy replica"]) == \
        "UnshardableModel: shards: 2: mlx-lm cannot split it | Gateway: no healthy replica"


def test_sigterm_while_starting_is_an_interrupt_once():
    import os
    import signal

    from cluster.cli import _term_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with _term_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next bytecode
            pytest.fail("SIGTERM did not interrupt")
    assert signal.getsignal(signal.SIGTERM) == before  # restored after the start
