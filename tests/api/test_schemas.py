import pytest
from pydantic import ValidationError

from cluster.api.errors import from_validation_errors
from cluster.api.schemas import ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, **kw})


def error_of(cls, body):
    with pytest.raises(ValidationError) as e:
        cls.model_validate(body)
    return from_validation_errors(e.value.errors())


def test_defaults_follow_openai():
    r = chat()
    assert (r.temperature, r.top_p, r.n, r.stream, r.requested_max_tokens()) == (None, 1.0, 1, False, None)
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).requested_max_tokens() == 16


def test_max_completion_tokens_wins():
    assert chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens() == 7


@pytest.mark.parametrize("field,value,param", [
    ("max_tokens", -1, "max_tokens"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", 1 << 21, "max_tokens"),
    ("max_tokens", "12", "max_tokens"),
    ("temperature", 2.5, "temperature"),
    ("temperature", -0.1, "temperature"),
    ("temperature", "0.5", "temperature"),
    ("temperature", float("nan"), "temperature"),
    ("presence_penalty", float("inf"), "presence_penalty"),
    ("top_p", 0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("n", 2, "n"),
    ("stream", "yes", "stream"),
    ("seed", 1.5, "seed"),
    ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"),
    ("repetition_penalty", -1, "repetition_penalty"),
    ("top_k", -1, "top_k"),
    ("min_p", 1.5, "min_p"),
    ("logit_bias", {"x": 1}, "logit_bias"),
    ("logit_bias", {"5": 101}, "logit_bias.5"),
    ("top_logprobs", 21, "top_logprobs"),
    ("xtc_probability", 0.5, "xtc_probability"),
    ("functions", [{"name": "f"}], "functions"),
    ("stop", ["x"] * 17, "stop"),
])
def test_bad_fields_are_400_naming_the_field(field, value, param):
    err = error_of(ChatCompletionRequest, {"model": "m", "messages": MSG, field: value})
    assert (err.status, err.param, err.type) == (400, param, "invalid_request_error")


def test_empty_messages_and_missing_model():
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": []}).param == "messages"
    err = error_of(ChatCompletionRequest, {"messages": MSG})
    assert (err.param, err.code) == ("model", "missing_required_parameter")


def test_bad_role_and_non_text_content():
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}).param == "messages.0.role"
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert error_of(ChatCompletionRequest, body).status == 400


@pytest.mark.parametrize("message", [{"role": "user", "content": None}, {"role": "user"},
                                     {"role": "system", "content": None}, {"role": "assistant", "content": None}])
def test_null_content_is_400_unless_an_assistant_turn_calls_tools(message):
    err = error_of(ChatCompletionRequest, {"model": "m", "messages": [*MSG, message]})
    assert (err.status, err.param) == (400, "messages.1.content")
    assert f"a {message['role']} message needs content" in err.message
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert chat(messages=[*MSG, {"role": "assistant", "content": None, "tool_calls": [call]}]).messages[1].text() == ""


def test_text_parts_are_joined():
    r = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert r.messages[0].text() == "ab"


def test_stop_forms():
    assert chat(stop="x").stop_list() == ("x",)
    assert chat(stop=["x", "y"]).stop_list() == ("x", "y")
    assert chat().stop_list() == ()


def test_completion_prompt_forms():
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["only"]}).prompt == "only"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompt == [1, 2]
    for bad in ("", [], ["a", "b"], 5):
        assert error_of(CompletionRequest, {"model": "m", "prompt": bad}).param == "prompt"


def test_unknown_fields_are_ignored():
    assert chat(user="u", logit_bias=None, some_future_field=1).model == "m"


def test_body_not_an_object():
    err = from_validation_errors([{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}])
    assert err.status == 400 and err.param is None and "JSON object" in err.message


def test_a_body_sent_as_another_content_type_is_told_so():
    """FastAPI parses only a JSON content type: a JSON object sent as text/plain fails as "not an object"."""
    errors = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}]
    err = from_validation_errors(errors, "text/plain")
    assert (err.status, err.param, err.code) == (400, None, "invalid_content_type")
    assert err.message == ("The request body must be JSON, sent with Content-Type: application/json "
                           "(this one was sent as 'text/plain')")
    assert from_validation_errors(errors, "application/json; charset=utf-8").code != "invalid_content_type"
    assert from_validation_errors(errors, "application/vnd.api+json").code != "invalid_content_type"
    for other in ("text/json", "application/x-ndjson"):  # FastAPI does not read these as JSON either
        assert from_validation_errors(errors, other).code == "invalid_content_type"


def test_a_body_sent_without_a_content_type_is_told_so():
    """FastAPI (strict_content_type) does not guess JSON: a browser's cross-site POST may come without one."""
    errors = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}]
    err = from_validation_errors(errors, None)
    assert (err.status, err.param, err.code) == (400, None, "invalid_content_type")
    assert err.message == ("The request body must be JSON, sent with Content-Type: application/json "
                           "(this one was sent without a Content-Type)")
    empty = from_validation_errors([{"type": "missing", "loc": ("body",), "msg": "Field required"}], None)
    assert empty.code == "missing_required_parameter"  # no body at all is told as that, whatever its type


def test_a_validator_message_is_shown_without_pydantics_prefix():
    err = error_of(ChatCompletionRequest, {"model": "m", "messages": MSG, "n": 2})
    assert err.message == "Invalid value for 'n': only n=1 is supported"


def test_a_union_field_is_one_problem_and_other_fields_are_counted():
    err = error_of(ChatCompletionRequest, {"model": "m", "messages": MSG, "tool_choice": "sometimes"})
    assert (err.param, err.message) == ("tool_choice", "Invalid value for 'tool_choice': Input should be 'none', "
                                                       "'auto' or 'required'")
    err = error_of(ChatCompletionRequest, {"model": "m", "messages": MSG, "tool_choice": "sometimes", "n": 2, "top_p": 9})
    assert err.message.endswith(" (and 2 more problems)")
    # an object is told what is wrong inside it, not that it is none of the strings
    err = error_of(ChatCompletionRequest, {"model": "m", "messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {}}})
    assert (err.param, err.code, err.message) == ("tool_choice.function.name", "missing_required_parameter",
                                                  "Missing required parameter: 'tool_choice.function.name'.")


def test_an_empty_body_names_the_model_as_missing():
    err = from_validation_errors([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    assert (err.status, err.param, err.code) == (400, "model", "missing_required_parameter")
    assert err.message == "The request body is empty: missing required parameter: 'model'."


def test_json_invalid():
    err = from_validation_errors([{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error"}])
    assert (err.status, err.code) == (400, "invalid_json")


@pytest.mark.parametrize("extra,param", [
    ({"top_logprobs": 5}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
])
def test_fields_that_disagree_name_the_one_to_fix(extra, param):
    err = error_of(ChatCompletionRequest, {"model": "m", "messages": MSG, **extra})
    assert (err.status, err.param) == (400, param)
    assert err.message.startswith(f"Invalid value for '{param}': ") and "Value error" not in err.message


@pytest.mark.parametrize("cls,body", [(ChatCompletionRequest, {"messages": MSG}), (CompletionRequest, {"prompt": "x"})])
def test_stream_options_need_stream(cls, body):
    for stream in ({}, {"stream": False}):
        err = error_of(cls, {"model": "m", **body, **stream, "stream_options": {"include_usage": True}})
        assert (err.status, err.param, err.message) == (
            400, "stream_options", "Invalid value for 'stream_options': stream_options is only allowed when stream is true")
    ok = cls.model_validate({"model": "m", **body, "stream": True, "stream_options": {"include_usage": True}})
    assert ok.include_usage()
    assert not cls.model_validate({"model": "m", **body, "stream_options": None}).include_usage()
