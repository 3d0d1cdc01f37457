"""OpenAI request bodies, validated by pydantic.

Numbers and flags are strict (a string "0.5" is not a temperature), unknown
fields are ignored as OpenAI clients send many optional ones, and fields we
accept but cannot honour are refused with a 400 that says so rather than
silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

MAX_TOKENS_LIMIT = 1 << 20
MAX_STOPS = 16

Temperature = Annotated[Union[StrictInt, StrictFloat], Field(ge=0.0, le=2.0)]
TopP = Annotated[Union[StrictInt, StrictFloat], Field(gt=0.0, le=1.0)]
MaxTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: Optional[StrictStr] = None

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
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: Optional[StrictInt] = None
    presence_penalty: Optional[Union[StrictInt, StrictFloat]] = 0
    frequency_penalty: Optional[Union[StrictInt, StrictFloat]] = 0
    user: Optional[StrictStr] = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v):
        if v:
            raise ValueError("penalties are not supported; leave it at 0")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[MaxTokens] = None
    logprobs: Optional[StrictBool] = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported yet")
        return v

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Optional[MaxTokens] = 16
    echo: Optional[StrictBool] = False
    suffix: Optional[StrictStr] = None
    logprobs: Optional[StrictInt] = None

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

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported yet")
        return v

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens
