import pytest
from pydantic import ValidationError

from cluster.config import AppConfig, CacheConfig, FleetConfig, ModelSpec


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


def test_duplicate_model_names_are_refused():
    with pytest.raises(ValidationError, match="repeats"):
        AppConfig(models=[ModelSpec.parse("tiny-dense"), ModelSpec.parse("tiny-dense")])


def test_app_config_round_trips_through_yaml_form():
    cfg = AppConfig(models=[ModelSpec.parse("tiny-swa")], redis_url="redis://127.0.0.1:1/0")
    assert AppConfig.model_validate(cfg.model_dump()) == cfg
