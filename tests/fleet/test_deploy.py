"""`mlx-fleet deploy` refuses a wrong file by the field's name, before it reaches any cluster."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.fleet.deploy import DeployError, dashboard_address, load_serve_file, summarize

SERVE = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"


def variant(tmp_path, change) -> Path:
    doc = yaml.safe_load(SERVE.read_text())
    change(doc)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_shipped_file_loads():
    assert load_serve_file(SERVE)["applications"][0]["import_path"] == "cluster.actors.app:build_app"


@pytest.mark.parametrize("change, named", [
    (lambda d: d["applications"][0]["args"]["cache"].update(blok_tokens=64), "applications[0].args.cache.blok_tokens"),
    (lambda d: d["applications"][0]["args"]["models"][0].update(max_ongoing_requests="many"),
     "applications[0].args.models.0.max_ongoing_requests"),
    (lambda d: d["applications"][0].pop("import_path"), "import_path"),
    (lambda d: d.pop("applications"), "applications"),
])
def test_a_wrong_file_is_refused_naming_the_field(tmp_path, change, named):
    with pytest.raises(DeployError, match=named.replace("[", r"\[").replace("]", r"\]")):
        load_serve_file(variant(tmp_path, change))


def test_the_cli_says_it_in_one_line_and_exits_nonzero(tmp_path):
    path = variant(tmp_path, lambda d: d["applications"][0]["args"].update(colour="blue"))
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "deploy", str(path)], capture_output=True, text=True)
    assert r.returncode == 1 and "applications[0].args.colour" in r.stderr and "Traceback" not in r.stderr


def test_the_dashboard_address_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("RAY_DASHBOARD_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # the head's GCS: its dashboard is on the same host
    assert dashboard_address() == "http://10.0.0.1:8265"
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert dashboard_address() == "http://127.0.0.1:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.1:8265/")
    assert dashboard_address() == "http://10.0.0.1:8265"
    assert dashboard_address("http://head:8265") == "http://head:8265"
    with pytest.raises(DeployError):
        dashboard_address("head:8265")


def test_progress_counts_running_replicas_and_sees_failures():
    details = {"applications": {"mlx-fleet": {"status": "DEPLOYING", "deployments": {
        "Gateway": {"target_num_replicas": 2, "replicas": [{"state": "RUNNING"}, {"state": "STARTING"}]}}}}}
    assert summarize(details, ["mlx-fleet"]) == ("mlx-fleet: DEPLOYING, 1/2 replicas running", False, "")
    details["applications"]["mlx-fleet"].update(status="RUNNING")
    details["applications"]["mlx-fleet"]["deployments"]["Gateway"]["replicas"][1]["state"] = "RUNNING"
    assert summarize(details, ["mlx-fleet"])[1] is True
    details["applications"]["mlx-fleet"].update(status="DEPLOY_FAILED", message="boom")
    assert summarize(details, ["mlx-fleet"])[2] == "mlx-fleet: boom"
