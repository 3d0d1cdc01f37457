import pytest
from pydantic import ValidationError

from cluster.config import AppConfig, CacheConfig, FleetConfig, ModelSpec, first_error, ranks_overflow, sharded_replicas


def test_every_field_has_a_description():
    for cls in (AppConfig, CacheConfig, FleetConfig, ModelSpec):
        missing = [n for n, f in cls.model_fields.items() if not f.description]
        assert not missing, f"{cls.__name__} fields without description: {missing}"


def test_extra_keys_are_refused_with_the_name():
    with pytest.raises(ValidationError, match="blok_tokens"):
        CacheConfig.model_validate({"blok_tokens": 64})


def test_block_tokens_bounds():
    with pytest.raises(ValidationError, match="block_tokens"):
        CacheConfig(block_tokens=8)
    assert CacheConfig(block_tokens=256).block_tokens == 256


def test_an_empty_model_source_is_named():
    with pytest.raises(ValidationError, match="source is empty"):
        ModelSpec.parse("foo=")


def test_model_spec_parse():
    assert ModelSpec.parse("tiny-swa") == ModelSpec(name="tiny-swa", source="tiny-swa")
    assert ModelSpec.parse("qwen=mlx-community/Qwen3-4B-4bit").name == "qwen"
    assert ModelSpec.parse("mlx-community/Qwen3-4B-4bit").name == "mlx-community/Qwen3-4B-4bit"
    assert ModelSpec.parse("/models/my-llama").name == "my-llama"


def test_duplicate_model_names_are_refused_under_models():
    with pytest.raises(ValidationError) as e:
        AppConfig(models=[ModelSpec.parse("tiny-dense"), ModelSpec.parse("tiny-dense")])
    assert e.value.errors()[0]["loc"] == ("models",)
    assert "['tiny-dense'] repeats: give each model its own `name`" in e.value.errors()[0]["msg"]


@pytest.mark.parametrize("cls, field", [(CacheConfig, "ram_bytes"), (CacheConfig, "disk_bytes"),
                                        (CacheConfig, "store_timeout_s"), (ModelSpec, "max_context")])
def test_a_boolean_is_not_a_number(cls, field):
    """YAML's `true` would otherwise be 1: a 1-byte RAM tier, a 1-token context."""
    data = {"name": "m", "source": "tiny-dense"} if cls is ModelSpec else {}
    with pytest.raises(ValidationError) as e:
        cls.model_validate({**data, field: True})
    assert first_error(e.value) == (field, "true is a boolean; give a number")
    assert CacheConfig.model_validate({"enabled": False}).enabled is False  # booleans stay booleans


def test_an_unknown_key_gets_the_closest_field_of_its_place():
    for data, where, hint in (({"cache": {"block_token": 64}}, "cache.block_token", "did you mean block_tokens?"),
                              ({"models": [{"name": "m", "source": "s", "max_contxt": 9}]}, "models[0].max_contxt",
                               "did you mean max_context?")):
        with pytest.raises(ValidationError) as e:
            AppConfig.model_validate(data)
        assert first_error(e.value, AppConfig) == (where, f"no such setting; {hint}")


def test_errors_name_list_items_by_index():
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate({"models": [{"name": "m", "source": "tiny-dense", "max_context": 8}]})
    assert first_error(e.value) == ("models[0].max_context", "Input should be greater than or equal to 16")


@pytest.mark.parametrize("cls", [AppConfig, FleetConfig])
def test_a_redis_url_must_be_one_and_is_not_echoed(cls):
    for url, said in (("http://u:s3cret@10.0.0.1:6379", "this one starts with 'http://'"),
                      ("redis:/:s3cret@10.0.0.1:6380/0", "this one needs // after redis:"),
                      ("10.0.0.1:6379", "this one has no scheme")):
        with pytest.raises(ValidationError) as e:
            cls.model_validate({"redis_url": url})
        field, msg = first_error(e.value)
        assert field == "redis_url" and msg.startswith("a Redis URL starts with redis://") and msg.endswith(said)
        assert "s3cret" not in str(e.value)
    for url in ("redis://:pw@10.0.0.1:6380/0", "rediss://h:6380/0", "unix:///tmp/redis.sock", None):
        assert cls.model_validate({"redis_url": url}).redis_url == url
    assert cls.model_validate({"redis_url": " "}).redis_url is None  # empty: none (`--redis-url "$UNSET"`)


def test_sharded_models_share_the_nodes_one_rank_per_node():
    def spec(name, shards, replicas=None):
        return ModelSpec(name=name, source="tiny-dense", shards=shards, num_replicas=replicas)

    whole, a, b = spec("whole", 1), spec("a", 2), spec("b", 2)
    assert sharded_replicas([whole, a], 4) == {"a": 2}  # unsharded replicas take slivers of every node
    assert sharded_replicas([whole, a, b], 4) == {"a": 1, "b": 1}  # 2 + 2 ranks on 4 nodes
    assert sharded_replicas([a, b], 9) == {"a": 2, "b": 2}
    assert sharded_replicas([a, spec("c", 3)], 4) == {"a": 1, "c": 1}  # at least one each: too many, below
    assert ranks_overflow([whole, a, b], 4) is None and ranks_overflow([spec("a", 2, 2), b], 6) is None
    assert ranks_overflow([spec("a", 2, 2), b], 5) == (
        "the sharded replicas need 6 nodes, one rank per node (replicas x shards: a 2 x 2, b 1 x 2), and the fleet "
        "has 5; start more nodes (--nodes 6), lower num_replicas, or shard fewer models")
    with pytest.raises(ValidationError) as e:
        FleetConfig.model_validate({"nodes": 4, "app": {"models": [a.model_dump(), spec("c", 3).model_dump()]}})
    assert first_error(e.value)[1].startswith("the sharded replicas need 5 nodes")
