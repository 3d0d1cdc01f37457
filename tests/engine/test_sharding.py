"""How a model is split over ranks (engine/sharding.py): the mode chosen, and refusals that name the fix.

The two-process runs of each mode are in test_lockstep.py; here, what is decided before any rank starts.
"""

import pytest

from cluster.engine.sharding import UnshardableModel, check_shardable, families, geometry, ranks_by_node
from cluster.models.catalog import BUILTINS


def config_of(name: str) -> dict:
    return BUILTINS[name].config


def test_auto_takes_tensor_where_the_family_has_it_and_pipeline_where_only_that():
    assert check_shardable("qwen3", "auto", 2, config_of("tiny-dense")) == "tensor"
    assert check_shardable("qwen3_5", "auto", 2, config_of("tiny-hybrid")) == "tensor"
    assert check_shardable("qwen3_5", "pipeline", 2, config_of("tiny-hybrid")) == "pipeline"
    assert check_shardable("qwen3_next", "auto", 2, config_of("tiny-next")) == "pipeline"  # it has no shard()
    known = families()
    assert {"qwen3", "llama", "qwen3_5", "qwen3_moe"} <= set(known["tensor"])
    assert {"qwen3_5", "qwen3_next", "qwen3_moe", "qwen2"} <= set(known["pipeline"])
    assert "qwen3" not in known["pipeline"] and "qwen3_next" not in known["tensor"]
    assert "gemma3_text" not in known["tensor"] + known["pipeline"]


def test_a_family_that_cannot_split_is_refused_with_the_families_that_can():
    with pytest.raises(UnshardableModel) as e:
        check_shardable("gemma3_text", "auto", 2, config_of("tiny-swa"))
    message = str(e.value)
    assert message.startswith("shards: 2: mlx-lm cannot split 'gemma3_text' models in either mode; tensor parallel "
                              "can split ")
    assert "qwen3, " in message and "; pipeline parallel can split " in message
    with pytest.raises(UnshardableModel, match="cannot split 'qwen3' models in pipeline parallel"):
        check_shardable("qwen3", "pipeline", 2, config_of("tiny-dense"))


def test_a_split_the_model_cannot_take_names_the_values_that_fit():
    heads = config_of("tiny-dense")["num_key_value_heads"]
    with pytest.raises(UnshardableModel, match=rf"shards: 3 does not divide the model's num_key_value_heads "
                                               rf"\({heads}\); choose shards among"):
        check_shardable("qwen3", "tensor", 3, config_of("tiny-dense"))
    layers = config_of("tiny-hybrid")["num_hidden_layers"]
    with pytest.raises(UnshardableModel, match=rf"more than the model's {layers} layers"):
        check_shardable("qwen3_5", "pipeline", layers + 1, config_of("tiny-hybrid"))
    with pytest.raises(UnshardableModel, match="use tensor, pipeline or auto"):
        check_shardable("qwen3", "ring", 2, config_of("tiny-dense"))


def test_a_ranks_geometry_names_mode_size_and_rank():
    assert geometry("pipeline", 2, 1) == {"mode": "pipeline", "size": 2, "rank": 1}


def test_a_node_keeps_its_rank_whichever_node_the_replica_lands_on():
    # The leader's node first, then its followers': ranks follow the node ids, so node-0 is rank 0 both times
    assert ranks_by_node(["node-1-5e6f", "node-0-1a2b"]) == [1, 0]
    assert ranks_by_node(["node-0-1a2b", "node-1-5e6f"]) == [0, 1]
    assert ranks_by_node(["c", "a", "d", "b"]) == [2, 0, 3, 1]
