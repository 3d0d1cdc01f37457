"""A fleet serving every built-in model with TurboQuant-packed blocks: cached answers, the measured quality
in status. One fleet, at 4 bits (the lossier codec a user picks); every bit width restores exactly what it
packed in process (tests/kvcache/test_turboquant_cache.py), so a second fleet would retest the wiring only."""

import httpx
import pytest

from tests.local_fleet import LocalFleet

pytestmark = pytest.mark.fleet
MODELS = ("tiny-dense", "tiny-swa", "tiny-hybrid", "tiny-gemma4", "tiny-next")


@pytest.fixture(scope="module", params=["tq4"])
def fleet(request, tmp_path_factory):
    with LocalFleet(tmp_path_factory.mktemp(request.param), nodes=1, models=MODELS,
                    extra=("--kv-codec", request.param)) as f:
        f.codec = request.param
        yield f
    assert f.processes() == []


def test_every_model_answers_from_its_packed_blocks(fleet):
    prompt = " ".join(["Packed blocks still answer, and they answer fast."] * 12)
    with httpx.Client(base_url=fleet.url, timeout=300) as http:
        for model in MODELS:
            body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            runs = [http.post("/v1/completions", json=body) for _ in range(2)]
            assert [r.status_code for r in runs] == [200, 200], (model, runs[0].text)
            cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in runs]
            assert cached[0] == 0 and cached[1] > 0, (model, cached)


def test_status_reports_the_codec_and_its_measured_quality(fleet):
    replicas = fleet.status()["replicas"]
    assert sorted(r["model"] for r in replicas) == sorted(MODELS)
    for r in replicas:
        q = r["cache"]["codec_quality"]
        assert q["codec"] == fleet.codec and q["cosine_mean"] >= {"tq8": 0.9999, "tq4": 0.995}[fleet.codec], r["model"]
