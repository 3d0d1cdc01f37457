"""`mlx-fleet deploy` refuses a wrong file by the field's name, before it reaches any cluster."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from cluster.fleet.deploy import DeployError, dashboard_address, load_serve_file, summarize

SERVE_FILE = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"
SERVE = f"Ray {ray.__version__}'s Serve"


def variant(tmp_path, change) -> Path:
    doc = yaml.safe_load(SERVE_FILE.read_text())
    change(doc)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_shipped_file_loads():
    assert load_serve_file(SERVE_FILE)["applications"][0]["import_path"] == "cluster.actors.app:build_app"


@pytest.mark.parametrize("change, named", [
    (lambda d: d["applications"][0]["args"]["cache"].update(blok_tokens=64), "applications[0].args.cache.blok_tokens: no such setting; did you mean block_tokens?"),
    (lambda d: d["applications"][0]["args"]["models"][0].update(max_ongoing_requests="many"),
     "applications[0].args.models[0].max_ongoing_requests"),
    (lambda d: d["applications"][0].pop("import_path"), "import_path"),
    (lambda d: d.pop("applications"), "applications"),
    (lambda d: d.update(htp_options=d.pop("http_options")), f"htp_options: {SERVE} has no such setting; did you mean http_options"),
    (lambda d: d["http_options"].update(prot=8001), f"http_options.prot: {SERVE} has no such setting; did you mean port?"),
    (lambda d: d["applications"][0].update(deployments=[{"name": "Gateway", "ray_actor_options": {"num_cpu": 1}}]),
     f"applications[0].deployments[0].ray_actor_options.num_cpu: {SERVE} has no such setting; did you mean num_cpus"),
    (lambda d: d["applications"][0].update(deployments=[{"name": "Gateway", "deployment_actors": [
        {"name": "x", "actor_class": "m:C", "actor_option": {}}]}]),
     f"applications[0].deployments[0].deployment_actors[0].actor_option: {SERVE} has no such setting; "
     "did you mean actor_options?"),
    (lambda d: d["applications"][0].update(import_path="cluster.actors.ap:build_app"),
     "applications[0].import_path: 'cluster.actors.ap:build_app' is not mlx-fleet's application; "
     "did you mean cluster.actors.app:build_app?"),
    (lambda d: d["applications"][0]["args"]["models"].append(d["applications"][0]["args"]["models"][0]),
     "applications[0].args.models: model names must be unique, ['qwen3-4b'] repeats: give each model its own `name`"),
    (lambda d: d["applications"][0]["args"].update(redis_url="http://10.0.0.1:6380"),
     "applications[0].args.redis_url: a Redis URL starts with redis://"),
])
def test_a_wrong_file_is_refused_naming_the_field(tmp_path, change, named):
    with pytest.raises(DeployError, match=re.escape(named)):
        load_serve_file(variant(tmp_path, change))


def test_other_applications_pass_as_they_are(tmp_path):
    """Another app's args are its own; so is a package of theirs that is also called `cluster`."""
    path = variant(tmp_path, lambda d: d["applications"].extend([
        {"name": "other", "route_prefix": "/other", "import_path": "their_app.main:app", "args": {"anything": 1}},
        {"name": "theirs", "route_prefix": "/theirs", "import_path": "cluster.main:app"}]))
    assert [a["name"] for a in load_serve_file(path)["applications"]] == ["mlx-fleet", "other", "theirs"]


def test_a_key_given_twice_is_named_with_its_line(tmp_path):
    """PyYAML, and so Serve, would keep the second and drop the first without a word."""
    path = tmp_path / "serve.yaml"
    path.write_text(SERVE_FILE.read_text().replace("      data_dir: ~/.mlx-fleet\n",
                                                   "      data_dir: ~/.mlx-fleet\n      data_dir: /Volumes/ssd\n"))
    with pytest.raises(DeployError) as e:
        load_serve_file(path)
    line = SERVE_FILE.read_text().splitlines().index("      data_dir: ~/.mlx-fleet") + 2
    assert str(e.value) == (f"{path} is not valid YAML: 'data_dir' is given twice in one mapping in \"{path}\", "
                            f"line {line}, column 7")


def test_an_empty_application_list_is_named(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("applications: []\n")
    with pytest.raises(DeployError, match=re.escape("`applications` is missing or empty")):
        load_serve_file(path)


def test_our_app_by_its_dotted_path_is_ours_and_checked(tmp_path):
    """Ray takes `module.attr` for `module:attr`: the app is ours either way, so its args are checked."""
    dotted = lambda d: d["applications"][0].update(import_path="cluster.actors.app.build_app")  # noqa: E731
    assert load_serve_file(variant(tmp_path, dotted))["applications"][0]["import_path"] == "cluster.actors.app.build_app"
    with pytest.raises(DeployError, match=re.escape("applications[0].args.colour")):
        load_serve_file(variant(tmp_path, lambda d: (dotted(d), d["applications"][0]["args"].update(colour="blue"))))


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
