"""OpenAI request bodies, validated by pydantic.

Numbers and flags are strict (a string "0.5" is not a temperature), text must
be valid Unicode (a lone surrogate cannot be tokenized), unknown fields are
ignored as OpenAI clients send many optional ones, and fields we accept but
cannot honour are refused with a 400 that names them rather than silently
dropped: functions and function_call (use tools), best_of > 1, n > 1, suffix,
XTC sampling.

Beyond OpenAI's fields, mlx_lm.server's are accepted with its names and
defaults: top_k, min_p, repetition_penalty and the *_context_size of each
penalty (how many of the latest tokens it looks at, 20).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      field_validator, model_validator)

from cluster.api.errors import FieldConflict
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
Temperature = Annotated[StrictFloat, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[StrictFloat, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
MaxTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Seed = Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)]
Number = Union[StrictInt, Annotated[StrictFloat, Field(allow_inf_nan=False)]]  # NaN is no number a sampler takes
FunctionName = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
Penalty = Annotated[Number, Field(ge=-2.0, le=2.0)]
ContextSize = Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS_LIMIT)]
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


def _unsupported(name: str, why: str):
    """A validator refusing a non-default value of a field we cannot honour."""

    def check(v):
        if v:
            raise ValueError(f"{name} is not supported by mlx-fleet yet ({why}); leave it out")
        return v

    return check


class OpenAIObject(BaseModel):
    """A part of a request body: unknown fields ignored, as OpenAI clients send many optional ones."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIObject):
    include_usage: StrictBool = False


class TextPart(OpenAIObject):
    type: Literal["text"]
    text: Text


class FunctionCall(OpenAIObject):
    name: Text
    arguments: Text  # JSON, as OpenAI sends it


class ToolCallIn(OpenAIObject):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: Optional[Text] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(OpenAIObject):
    name: FunctionName
    description: Optional[Text] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class Tool(OpenAIObject):
    type: Literal["function"]
    function: FunctionSpec


class NamedTool(OpenAIObject):
    name: StrictStr


class ToolChoiceFunction(OpenAIObject):
    type: Literal["function"]
    function: NamedTool


class JsonSchemaFormat(OpenAIObject):
    name: FunctionName
    description: Optional[Text] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(OpenAIObject):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class ChatMessage(OpenAIObject):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[TextPart], None] = None
    name: Optional[Text] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[Text] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Sampling(OpenAIObject):
    """Fields shared by chat and text completions."""

    model: StrictStr
    max_tokens: Optional[MaxTokens] = None
    temperature: Optional[Temperature] = None  # the model's default_temperature (0, as mlx_lm.server)
    top_p: Optional[TopP] = 1.0
    n: Optional[StrictInt] = 1
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[Text, list[Text], None] = None
    seed: Optional[Seed] = None
    presence_penalty: Optional[Penalty] = 0.0
    frequency_penalty: Optional[Penalty] = 0.0
    repetition_penalty: Optional[Annotated[Number, Field(ge=0.0)]] = 0.0
    presence_context_size: Optional[ContextSize] = 20
    frequency_context_size: Optional[ContextSize] = 20
    repetition_context_size: Optional[ContextSize] = 20
    top_k: Optional[Annotated[StrictInt, Field(ge=0)]] = 0
    min_p: Optional[Annotated[Number, Field(ge=0.0, le=1.0)]] = 0.0
    xtc_probability: Optional[Number] = 0.0
    logit_bias: Optional[dict[str, Annotated[Number, Field(ge=-100, le=100)]]] = None
    user: Optional[StrictStr] = None

    _n = field_validator("n")(lambda v: _one_choice(v, "n"))
    _xtc = field_validator("xtc_probability")(_unsupported("XTC sampling", "its draws cannot follow a request's seed"))

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        for key in v or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids; {key!r} is not an integer")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        # As OpenAI and vLLM answer: include_usage on a non-streamed reply would be silently dropped.
        if self.stream_options is not None and not self.stream:
            raise FieldConflict("stream_options", "stream_options is only allowed when stream is true")
        return self

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
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceFunction, None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    response_format: Optional[ResponseFormat] = None

    _functions = field_validator("functions", "function_call")(
        _unsupported("functions / function_call", "the deprecated form of tools; send tools and tool_choice"))

    @model_validator(mode="after")
    def _consistent(self):
        for i, m in enumerate(self.messages):  # as OpenAI: only an assistant turn that calls tools may have none
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise FieldConflict(f"messages.{i}.content", f"a {m.role} message needs content (a string or a list "
                                    "of text parts); only an assistant message with tool_calls may leave it null")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldConflict("top_logprobs", "top_logprobs needs logprobs: true")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise FieldConflict("tool_choice", "tool_choice needs tools")
        if isinstance(choice, ToolChoiceFunction) and choice.function.name not in {t.function.name for t in self.tools}:
            raise FieldConflict("tool_choice", f"tool_choice names {choice.function.name!r}, which is not among the tools")
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema_ is None):
            raise FieldConflict("response_format", "response_format json_schema needs json_schema.schema")
        if fmt is not None and fmt.type != "text" and choice not in (None, "none", "auto"):
            raise FieldConflict("response_format", "response_format and a forced tool_choice cannot both constrain the reply")
        return self

    def logprobs_count(self) -> Optional[int]:
        """None: no logprobs; N: the chosen token's and the top N."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[Text, list[StrictInt], list[Text], list[list[StrictInt]]]
    max_tokens: Optional[MaxTokens] = 16
    echo: Optional[StrictBool] = False
    suffix: Optional[Text] = None
    logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)]] = None
    best_of: Optional[StrictInt] = None

    _suffix = field_validator("suffix")(_unsupported("suffix", "no fill-in-the-middle"))

    def logprobs_count(self) -> Optional[int]:
        return self.logprobs
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
