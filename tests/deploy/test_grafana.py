"""The Grafana dashboard asks only for metrics the fleet exports, each as its kind is exported."""

import json
import re
from pathlib import Path

import yaml

from cluster.metrics import METRICS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NAME = re.compile(r"\bray_mlx_fleet_[a-z_]+")
# Ray exports a counter as <name>_total, a histogram as <name>_bucket/_count/_sum, a gauge as <name>.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported(series: str) -> bool:
    base = series.removeprefix("ray_")
    for name, spec in METRICS.items():
        if any(base == name + suffix for suffix in SUFFIXES[spec.kind]):
            return True
    return False


def test_every_panel_queries_metrics_the_fleet_exports():
    dash = json.loads((DEPLOY / "grafana" / "mlx-fleet.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    named = [n for e in exprs for n in NAME.findall(e)]
    assert named and all(NAME.search(e) for e in exprs)  # every query names one of ours
    assert [n for n in named if not exported(n)] == []
    # every metric the fleet exports has a panel
    assert {n for n in METRICS} <= {re.sub(r"_(total|bucket|count|sum)$", "", n.removeprefix("ray_")) for n in named}
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_the_scrape_config_reads_rays_service_discovery_file():
    cfg = yaml.safe_load((DEPLOY / "grafana" / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]


def test_every_metric_is_documented():
    doc = (DEPLOY.parent / "docs" / "metrics.md").read_text()
    assert [name for name in METRICS if f"`ray_{name}" not in doc] == []
