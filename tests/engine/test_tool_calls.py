"""Tool calls split out of streamed text, whatever the pieces, with mlx-lm's json_tools parser."""

import json

from mlx_lm.tool_parsers import json_tools

from cluster.engine.tool_calls import ToolCallSplitter

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def splitter() -> ToolCallSplitter:
    return ToolCallSplitter(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, None)


def run(pieces: list[str]) -> tuple[str, list]:
    s = splitter()
    content, calls = "", []
    for p in pieces:
        c, k = s.feed(p)
        content, calls = content + c, calls + k
    c, k = s.flush()
    return content + c, calls + k


def test_a_call_in_any_pieces_is_parsed_and_the_text_around_it_is_content():
    text = "Let me check. " + CALL + " done"
    for size in (1, 2, 3, 7, len(text)):
        content, calls = run([text[i:i + size] for i in range(0, len(text), size)])
        assert content == "Let me check.  done"
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
        assert calls[0].id.startswith("call_")


def test_two_calls_and_a_marker_prefix_that_is_not_a_call():
    content, calls = run(["a <tool", "_x> b ", CALL, CALL])
    assert content == "a <tool_x> b " and [c.name for c in calls] == ["get_weather", "get_weather"]


def test_a_cut_off_or_unparseable_call_is_given_back_as_text():
    assert run(["x ", CALL[:30]]) == ("x " + CALL[:30], [])
    bad = "<tool_call>{not json}</tool_call>"
    assert run([bad]) == (bad, [])
