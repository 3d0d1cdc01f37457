"""Everything a client of mlx_lm.server asks for, against mlx_lm.server itself, in the same test.

One fleet and one mlx_lm.server on the same built-in model (the same files): each
request goes to both, with logprobs: the text must be identical and logprobs
equal within 1e-4, for every sampling parameter and for the defaults. Then tool calling (forced with tool_choice, streaming and not, and the next
turn with the tool's answer), JSON mode and the 400s.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from cluster.bench.batch import MlxLmServer
from tests.local_fleet import LocalFleet

pytestmark = pytest.mark.fleet
MODEL = "tiny-dense"
MESSAGES = [{"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "the water people of the first time could make more"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                            "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with LocalFleet(tmp_path_factory.mktemp("sampling-fleet"), nodes=1) as f:
        yield f


@pytest.fixture(scope="module")
def reference(fleet, tmp_path_factory):
    with MlxLmServer(fleet.data_dir / "models" / MODEL, tmp_path_factory.mktemp("mlx-lm-server")) as server:
        yield server


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=120)


def both(fleet, reference, body: dict) -> tuple[dict, dict]:
    ours = httpx.post(f"{fleet.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=120)
    theirs = httpx.post(f"{reference.url}/v1/chat/completions",
                        json={"model": str(fleet.data_dir / "models" / MODEL), **body}, timeout=120)
    assert ours.status_code == 200, ours.text
    assert theirs.status_code == 200, theirs.text
    return ours.json(), theirs.json()


GREEDY = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0.0}


@pytest.mark.parametrize("extra", [
    {},
    {"repetition_penalty": 1.5},
    {"repetition_penalty": 1.3, "repetition_context_size": 4},
    {"presence_penalty": 1.5},
    {"presence_penalty": 0.8, "presence_context_size": 6},
    {"frequency_penalty": 1.2},
    {"frequency_penalty": 1.0, "frequency_context_size": 3},
    {"logit_bias": {"17": 6.0, "40": -100}},
    {"temperature": 0.9, "top_k": 5, "seed": 3},
    {"temperature": 0.8, "min_p": 0.2, "seed": 4},
    {"temperature": 1.0, "top_p": 0.7, "seed": 5},
    {"tools": TOOLS},  # the tools rendered into the prompt by the template, as mlx_lm.server renders them
    {"temperature": None},  # left out: both default to greedy
], ids=lambda e: "+".join(f"{k}=default" if v is None else k for k, v in e.items()) or "plain")
def test_sampling_parameters_give_mlx_lm_servers_tokens_and_logprobs(fleet, reference, extra):
    body = {k: v for k, v in {**GREEDY, **extra, "logprobs": True}.items() if v is not None}
    ours, theirs = both(fleet, reference, body)
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    mine = [t["logprob"] for t in ours["choices"][0]["logprobs"]["content"]]
    ref = [t["logprob"] for t in theirs["choices"][0]["logprobs"]["content"]]
    assert len(mine) == ours["usage"]["completion_tokens"]
    assert mine == pytest.approx(ref, abs=1e-4)


def test_logprobs_equal_mlx_lm_servers(fleet, reference):
    ours, theirs = both(fleet, reference, {**GREEDY, "logprobs": True, "repetition_penalty": 1.2})
    mine = ours["choices"][0]["logprobs"]["content"]
    ref = theirs["choices"][0]["logprobs"]["content"]
    assert len(mine) == len(ref) == ours["usage"]["completion_tokens"]
    for a, b in zip(mine, ref):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        assert a["logprob"] <= 0 and a["top_logprobs"] == []
    # top_logprobs: the same N tokens with the same values (ours best first, as OpenAI orders them)
    ours, theirs = both(fleet, reference, {**GREEDY, "logprobs": True, "top_logprobs": 5})
    for a, b in zip(ours["choices"][0]["logprobs"]["content"], theirs["choices"][0]["logprobs"]["content"]):
        top = a["top_logprobs"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["logprob"] == pytest.approx(a["logprob"], abs=1e-6)  # greedy: the chosen one is the best
        ref_top = {t["id"]: t["logprob"] for t in b["top_logprobs"]}
        assert sorted(t["logprob"] for t in top) == pytest.approx(sorted(ref_top.values()), abs=1e-4)


def test_streamed_logprobs_equal_the_whole_reply(client):
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**body)
    streamed = [e for chunk in client.chat.completions.create(**body, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert len(streamed) == whole.usage.completion_tokens


def test_completions_logprobs_are_openais_parallel_lists(client):
    r = client.completions.create(model=MODEL, prompt="the water", max_tokens=6, temperature=0.0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) <= 3 and max(t.values()) == pytest.approx(v, abs=1e-6)
               for t, v in zip(lp.top_logprobs, lp.token_logprobs))


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_parses_and_the_next_turn_reuses_the_prefix(client, fleet, stream):
    messages = [{"role": "user", "content": "what is the weather in the water city"}]
    body = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64, temperature=0.0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        chunks = list(client.chat.completions.create(**body, stream=True))
        calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        call = calls[0]
        assert [c.index for c in calls] == [0]
    else:
        r = client.chat.completions.create(**body)
        call, finish, content = r.choices[0].message.tool_calls[0], [r.choices[0].finish_reason], \
            r.choices[0].message.content
        assert len(r.choices[0].message.tool_calls) == 1
    assert finish == ["tool_calls"] and not content
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])

    # the next turn: the assistant's call and the tool's answer render through the template; the prefix is cached
    turn2 = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=turn2, tools=TOOLS, max_tokens=4,
                                                           temperature=0.0)
    r2 = raw.parse()
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_any_tool_with_tool_choice_required(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the time"}], tools=TOOLS,
                                       tool_choice="required", max_tokens=96, temperature=0.0)
    assert r.choices[0].message.tool_calls, r.choices[0].message.content
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in {"get_weather", "get_time"} and r.choices[0].finish_reason == "tool_calls"
    json.loads(call.function.arguments)


SMALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "tags"],
                "properties": {"name": {"type": "string", "maxLength": 10},
                               "count": {"type": "integer", "minimum": 0, "maximum": 99},
                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}}}


def test_json_mode_always_parses_and_a_schema_always_validates(client, fleet):
    from transformers import AutoTokenizer

    # Any object: a random model writes a string forever unless something favours closing it. A real model
    # closes its strings; here logit_bias (applied before the grammar's mask) stands in for that.
    tok = AutoTokenizer.from_pretrained(str(fleet.data_dir / "models" / MODEL))
    closing = {str(tok.convert_tokens_to_ids(c)): 8 for c in ('"', "}")}
    for i in range(20):
        kind = i % 2
        fmt = {"type": "json_object"} if kind == 0 else \
            {"type": "json_schema", "json_schema": {"name": "thing", "schema": SMALL_SCHEMA, "strict": True}}
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"item {i} as json"}],
                                           response_format=fmt, max_tokens=200, temperature=0.7, seed=i,
                                           logit_bias=closing if kind == 0 else None)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        value = json.loads(r.choices[0].message.content)
        assert isinstance(value, dict)
        if kind == 1:
            jsonschema.validate(value, SMALL_SCHEMA)


@pytest.mark.parametrize("body, param", [
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 2}, None),
    ({"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"messages": MESSAGES, "tool_choice": "required"}, None),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, "response_format"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
    ({"messages": MESSAGES, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"messages": MESSAGES, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": MESSAGES, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": MESSAGES, "top_k": -1}, "top_k"),
    ({"messages": MESSAGES, "min_p": 1.5}, "min_p"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
], ids=lambda v: "" if not isinstance(v, dict) else "-".join(k for k in v if k != "messages") or "messages")
def test_bad_values_get_openai_400s(fleet, body, param):
    r = httpx.post(f"{fleet.url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
