"""Fleets side by side: two `up`s at the same moment, on two data dirs, both come up and serve (each wants the
dashboard's port 8265, its Ray ports and its Redis: the race is the same with two as with more)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.local_fleet import LocalFleet

pytestmark = pytest.mark.fleet


def test_two_fleets_started_at_the_same_moment_both_come_up_and_serve(tmp_path):
    fleets = [LocalFleet(tmp_path / f"fleet{i}", nodes=1, dashboard=True) for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "cluster.cli", *f.up_args(), "--data-dir", str(f.data_dir)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
             for f in fleets]  # every one wants dashboard port 8265
    try:
        results = [p.communicate(timeout=900) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], results
        dashboards = {f.state().dashboard_url for f in fleets}
        assert len(dashboards) == 2  # each got its own, one of them 8265
        for f in fleets:
            r = httpx.post(f"{f.url}/v1/completions", json={"model": "tiny-dense", "prompt": "side by side",
                                                            "max_tokens": 2}, timeout=60)
            assert r.status_code == 200
            token = (f.data_dir / "ray-token").read_text().strip()
            with httpx.Client(trust_env=False, timeout=10) as dash:
                r = dash.get(f"{f.state().dashboard_url}/api/serve/applications/",
                             headers={"Authorization": f"Bearer {token}"})
                assert r.status_code == 200 and "mlx-fleet" in r.json()["applications"]  # its own, not another's
    finally:
        with ThreadPoolExecutor(len(fleets)) as pool:  # side by side too: each stops its own
            list(pool.map(lambda f: f.down(), fleets))
    assert all(f.processes() == [] for f in fleets)
