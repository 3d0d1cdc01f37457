"""A fleet serving every built-in model with TurboQuant-packed blocks at 4 bits: cached answers and the measured
quality in status. Every bit width (8, 4, 3, 2), the disk tier and peer pulls are checked in process
(tests/kvcache/test_turboquant_cache.py); the fleet's path is the same for each, so one width runs here."""

import time

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
            first = http.post("/v1/completions", json=body)
            assert first.status_code == 200, (model, first.text)
            assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            deadline = time.monotonic() + 20  # blocks are packed on a thread of their own, then stored
            while True:
                again = http.post("/v1/completions", json=body)
                assert again.status_code == 200, (model, again.text)
                cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                if cached > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert cached > 0, model


def test_status_reports_the_codec_and_its_measured_quality(fleet):
    replicas = fleet.status()["replicas"]
    assert sorted(r["model"] for r in replicas) == sorted(MODELS)
    for r in replicas:
        q = r["cache"]["codec_quality"]
        assert q["codec"] == fleet.codec and q["cosine_mean"] >= {"tq8": 0.9999, "tq4": 0.995}[fleet.codec], r["model"]
