"""OpenAI request bodies, validated by pydantic.

Numbers and flags are strict (a string "0.5" is not a temperature), text must
be valid Unicode (a lone surrogate cannot be tokenized), unknown fields are
ignored as OpenAI clients send many optional ones, and fields we accept but
cannot honour are refused with a 400 that names them rather than silently
dropped: tools, tool_choice, functions, response_format other than text,
logit_bias, logprobs, best_of > 1, n > 1, penalties, suffix.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      field_validator)

from cluster.engine.request import SEED_MAX, SEED_MIN

MAX_TOKENS_LIMIT = 1 << 20
MAX_STOPS = 16


def _valid_unicode(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text holds an invalid Unicode code point (a lone surrogate, {v[e.start]!r} at "
                         f"position {e.start}); send valid UTF-8 text") from None
    return v


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
Temperature = Annotated[StrictFloat, Field(ge=0.0, le=2.0)]
TopP = Annotated[StrictFloat, Field(gt=0.0, le=1.0)]
MaxTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Seed = Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)]


def _unsupported(name: str, why: str):
    """A validator refusing a non-default value of a field we cannot honour."""

    def check(v):
        if v:
            raise ValueError(f"{name} is not supported by mlx-fleet yet ({why}); leave it out")
        return v

    return check


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[TextPart], None] = None
    name: Optional[Text] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Sampling(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    max_tokens: Optional[MaxTokens] = None
    temperature: Optional[Temperature] = 1.0
    top_p: Optional[TopP] = 1.0
    n: Optional[StrictInt] = 1
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[Text, list[Text], None] = None
    seed: Optional[Seed] = None
    presence_penalty: Optional[Union[StrictInt, StrictFloat]] = 0
    frequency_penalty: Optional[Union[StrictInt, StrictFloat]] = 0
    logit_bias: Optional[dict[str, Any]] = None
    user: Optional[StrictStr] = None

    _n = field_validator("n")(lambda v: _one_choice(v, "n"))
    _penalties = field_validator("presence_penalty", "frequency_penalty")(
        _unsupported("penalties", "mlx-lm's penalty processors are not wired in"))
    _bias = field_validator("logit_bias")(_unsupported("logit_bias", "no logits processor for it"))

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _one_choice(v, name: str):
    if v is not None and v != 1:
        raise ValueError(f"only {name}=1 is supported")
    return v


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[MaxTokens] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None

    _logprobs = field_validator("logprobs", "top_logprobs")(_unsupported("logprobs", "not computed yet"))
    _tools = field_validator("tools", "functions")(_unsupported("tool calling", "no tool-call parser is wired in"))

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v):
        if v not in (None, "none", "auto"):
            raise ValueError("tool calling is not supported by mlx-fleet yet; leave tool_choice out")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v.get("type", "text") != "text":
            raise ValueError(f"response_format {v.get('type')!r} is not supported yet (no constrained decoding); "
                             "only {\"type\": \"text\"} is")
        return v

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[Text, list[StrictInt], list[Text], list[list[StrictInt]]]
    max_tokens: Optional[MaxTokens] = 16
    echo: Optional[StrictBool] = False
    suffix: Optional[Text] = None
    logprobs: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = None

    _suffix = field_validator("suffix")(_unsupported("suffix", "no fill-in-the-middle"))
    _logprobs = field_validator("logprobs")(_unsupported("logprobs", "not computed yet"))
    _best_of = field_validator("best_of")(lambda v: _one_choice(v, "best_of"))

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens
