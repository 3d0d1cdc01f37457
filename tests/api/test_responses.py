import json

from cluster.api.responses import SSE_DONE, Reply, sse
from cluster.engine.events import Finished

DONE = Finished("stop", prompt_tokens=5, completion_tokens=3, cached_tokens=2)


def parse(chunk: str) -> dict:
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    return json.loads(chunk[6:])


def test_chat_body_and_usage():
    body = Reply("m", chat=True).complete("hey", DONE)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hey"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 2}}


def test_text_completion_body():
    body = Reply("m", chat=False).complete("hey", DONE)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "hey"


def test_stream_chunks_share_id_and_carry_null_usage_when_asked():
    r = Reply("m", chat=True, include_usage=True)
    first, mid, last, use = (parse(r.chunk(text="", role=True)), parse(r.chunk(text="a")),
                             parse(r.chunk(finish_reason="length")), parse(r.usage_chunk(DONE)))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert mid["choices"][0]["delta"] == {"content": "a"} and mid["usage"] is None
    assert last["choices"][0]["finish_reason"] == "length"
    assert use["choices"] == [] and use["usage"]["total_tokens"] == 8
    assert len({c["id"] for c in (first, mid, last, use)}) == 1


def test_sse_framing():
    assert sse({"a": 1}) == 'data: {"a":1}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
