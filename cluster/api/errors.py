"""OpenAI-format errors.

Every error leaves the gateway as {"error": {"message", "type", "param", "code"}}
with a status that says whose fault it is: 4xx for the client's, 5xx only for
ours, and 503 + Retry-After when no replica can take the request now.
"""

from __future__ import annotations

import email.message
from typing import Optional

from fastapi.responses import JSONResponse


class FieldConflict(ValueError):
    """A request's fields that disagree with each other (a check of the whole body), naming the one to fix:
    pydantic reports such an error at the body itself, with no field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class APIError(Exception):
    """An error the gateway answers with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: Optional[str] = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str, available: list[str]) -> APIError:
    shown = model if len(model) <= 200 else model[:200] + f"... ({len(model)} characters)"  # never echo a huge name
    return APIError(404, f"The model '{shown}' does not exist. Available: {', '.join(available)}",
                    param="model", code="model_not_found")


def unavailable(message: str, retry_after_s: int) -> APIError:
    return APIError(503, message, type="service_unavailable", code="no_replica_available",
                    headers={"Retry-After": str(retry_after_s)})


def internal(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


_TYPE_TAGS = {"int", "float", "str", "bool", "list", "dict", "none", "json-or-python"}


def _field_path(loc, into_models: bool = False) -> list[str]:
    """The body path of an error, up to pydantic's first union-branch tag ('int', 'list[int]', a model's
    name, ...); with `into_models`, on through a model branch to the field inside it."""
    path = []
    for part in loc:
        text = str(part)
        if part == "body" and not path:
            continue
        if text[:1].isupper():  # a model class names its union branch (ToolChoiceFunction); fields are snake_case
            if into_models:
                continue
            break
        if text in _TYPE_TAGS or "[" in text or text.startswith(("function-", "constrained-")):
            break
        path.append(text)
    return path


def _is_json(content_type: Optional[str]) -> bool:
    """What FastAPI reads as JSON: application/json or application/*+json, parameters aside."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def from_validation_errors(errors: list[dict], content_type: Optional[str] = "application/json") -> APIError:
    """Turn FastAPI/pydantic validation errors into one 400 naming the first bad field.

    `content_type` is the request's header, None when it sent none."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") != "missing" and not _is_json(content_type):
        # FastAPI reads only a JSON content type as JSON: any other one, or none (it refuses to guess, against
        # cross-site requests a browser may send without one), makes even a JSON object "not an object"
        sent = "without a Content-Type" if content_type is None else f"as {content_type!r}"
        return bad_request(f"The request body must be JSON, sent with Content-Type: application/json "
                           f"(this one was sent {sent})", code="invalid_content_type")
    fields = [".".join(_field_path(e.get("loc", ()))) for e in errors]
    field = fields[0]
    # A union's branches each report the field: tell the one that got furthest into the input (an object
    # for tool_choice is told what is wrong inside it, not that it is not 'none', 'auto' or 'required')
    first = max((e for e, f in zip(errors, fields) if f == field), key=lambda e: len(e.get("loc", ())))
    loc = _field_path(first.get("loc", ()), into_models=True)
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"Request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    conflict = (first.get("ctx") or {}).get("error")
    if not loc and isinstance(conflict, FieldConflict):
        return bad_request(f"Invalid value for '{conflict.param}': {conflict}", conflict.param)
    if not loc and first.get("type") == "missing":  # no body at all: name the field every endpoint needs first
        return bad_request("The request body is empty: missing required parameter: 'model'.", "model",
                           code="missing_required_parameter")
    if not loc:
        return bad_request(f"The request body must be a JSON object with the API's fields: {first.get('msg', '')}")
    if first.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, code="missing_required_parameter")
    message = first.get("msg", "invalid value").removeprefix("Value error, ")  # pydantic's prefix for a ValueError
    # a union's branches all report one field: one problem, told once
    others = len(set(fields) - {field})
    more = f" (and {others} more problem{'s' if others > 1 else ''})" if others else ""
    return bad_request(f"Invalid value for '{param}': {message}{more}", param)
