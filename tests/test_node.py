"""Node identity: a persistent unique id in the node's data dir; the host name only as a label."""

import threading

import pytest

from cluster.node import current_node, persistent_id


def test_two_nodes_with_the_same_name_get_different_ids_that_persist(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FLEET_NODE_NAME", "studio")
    monkeypatch.setenv("MLX_FLEET_NODE_DATA_DIR", str(tmp_path / "mac-a"))
    a = current_node(tmp_path)
    monkeypatch.setenv("MLX_FLEET_NODE_DATA_DIR", str(tmp_path / "mac-b"))
    b = current_node(tmp_path)
    assert a.name == b.name == "studio" and a.node_id != b.node_id
    assert a.node_id.startswith("studio-") and b.node_id.startswith("studio-")
    monkeypatch.setenv("MLX_FLEET_NODE_DATA_DIR", str(tmp_path / "mac-a"))
    monkeypatch.setenv("MLX_FLEET_NODE_NAME", "renamed")
    assert current_node(tmp_path).node_id == a.node_id  # a restart, even a rename, keeps the id


def test_concurrent_first_uses_agree_on_one_id(tmp_path):
    ids = []
    threads = [threading.Thread(target=lambda: ids.append(persistent_id(tmp_path, "mini"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and (tmp_path / "node-id").read_text().strip() == ids[0]


def test_a_damaged_id_file_says_how_to_fix_it(tmp_path):
    (tmp_path / "node-id").write_text("not an id\n")
    with pytest.raises(ValueError, match="delete the file"):
        persistent_id(tmp_path, "mini")
