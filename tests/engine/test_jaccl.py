"""JACCL for a sharded replica (engine/jaccl.py): which device reaches which Mac, and clear refusals.

JACCL runs only on Macs (macOS 26.2+ with RDMA over Thunderbolt 5); here, what is decided before a group
starts, from what each rank reports, and the refusal a machine without it gives.
"""

import sys

import pytest

from cluster.engine.jaccl import (JacclUnavailable, check_available, device_matrix, links_of,
                                  parse_ibv_devices)

IBV_DEVICES = """    device          \t   node GUID
    ------          \t----------------
    rdma_en2        \t0000000000000000
    rdma_en3        \t0000000000000000
"""


def link(device: str, network: str) -> dict:
    return {"device": device, "network": network}


def test_a_ranks_links_are_its_rdma_devices_whose_interfaces_have_ipv4_subnets():
    devices = parse_ibv_devices(IBV_DEVICES)
    assert devices == ["rdma_en2", "rdma_en3"]
    addresses = {"en0": [("10.0.0.5", "255.255.255.0")], "en2": [("192.168.10.1", "255.255.255.252")],
                 "en3": []}  # en3's cable not addressed yet: no link
    assert links_of(devices, addresses) == [link("rdma_en2", "192.168.10.0/30")]


def test_two_macs_on_one_cable_reach_each_other_by_their_own_devices():
    links = [[link("rdma_en2", "192.168.10.0/30")], [link("rdma_en5", "192.168.10.0/30")]]
    assert device_matrix(links, ["a", "b"]) == [[None, "rdma_en2"], ["rdma_en5", None]]


def test_three_macs_in_a_mesh_and_two_cables_between_a_pair():
    links = [[link("rdma_en2", "192.168.1.0/30"), link("rdma_en3", "192.168.2.0/30"),
              link("rdma_en4", "192.168.4.0/30")],
             [link("rdma_en2", "192.168.1.0/30"), link("rdma_en3", "192.168.3.0/30"),
              link("rdma_en4", "192.168.4.0/30")],
             [link("rdma_en2", "192.168.2.0/30"), link("rdma_en3", "192.168.3.0/30")]]
    assert device_matrix(links, ["a", "b", "c"]) == [[None, ["rdma_en2", "rdma_en4"], "rdma_en3"],
                                                     [["rdma_en2", "rdma_en4"], None, "rdma_en3"],
                                                     ["rdma_en2", "rdma_en3", None]]


def test_four_macs_cabled_as_a_ring_in_rank_order_are_a_ring():
    net = {(0, 1): "10.0.1.0/30", (1, 2): "10.0.2.0/30", (2, 3): "10.0.3.0/30", (0, 3): "10.0.4.0/30"}
    links = [[link(f"rdma_en{b if a == r else a}", n) for (a, b), n in net.items() if r in (a, b)] for r in range(4)]
    matrix = device_matrix(links, ["a", "b", "c", "d"])
    assert [matrix[r][(r + 1) % 4] is not None for r in range(4)] == [True] * 4
    assert matrix[0][2] is None and matrix[1][3] is None  # no cable across: JACCL runs it as a ring


def test_macs_not_all_cabled_are_refused_naming_the_pairs_and_the_setup():
    links = [[link("rdma_en2", "10.0.1.0/30")], [link("rdma_en2", "10.0.1.0/30")], [link("rdma_en2", "10.0.9.0/30")]]
    with pytest.raises(JacclUnavailable, match=r"none found between a and c, b and c; set up RDMA over "
                                               r"Thunderbolt 5 \(on every Mac: macOS 26.2"):
        device_matrix(links, ["a", "b", "c"])
    with pytest.raises(JacclUnavailable, match=r"node b has no RDMA device with an IPv4 address; .*rdma_ctl enable"):
        device_matrix([[link("rdma_en2", "10.0.1.0/30")], []], ["a", "b"])


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac's MLX may have JACCL")
def test_an_mlx_without_jaccl_is_refused_with_the_fix():
    with pytest.raises(JacclUnavailable, match=r"this MLX has no JACCL; use shard_backend: ring \(`--shard-backend "
                                               r"ring`; TCP, any network\), or set up RDMA"):
        check_available()


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac's MLX may have JACCL")
def test_up_with_jaccl_where_mlx_has_none_stops_before_any_node_starts(capsys, tmp_path):
    from cluster.cli import main

    code = main(["up", "--nodes", "2", "--shards", "2", "--shard-backend", "jaccl", "--data-dir", str(tmp_path)])
    assert code == 1
    assert capsys.readouterr().err.startswith("mlx-fleet: shard_backend: jaccl: this MLX has no JACCL")
    assert not (tmp_path / "fleet.json").exists() and list(tmp_path.iterdir()) == []
