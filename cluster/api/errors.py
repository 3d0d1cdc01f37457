"""OpenAI-format errors.

Every error leaves the gateway as {"error": {"message", "type", "param", "code"}}
with a status that says whose fault it is: 4xx for the client's, 5xx only for
ours, and 503 + Retry-After when no replica can take the request now.
"""

from __future__ import annotations

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


def _field_path(loc) -> list[str]:
    """The body path of an error, without pydantic's union-branch tags ('int', 'list[int]', ...)."""
    path = []
    for part in loc:
        text = str(part)
        if part == "body" and not path:
            continue
        if text in _TYPE_TAGS or "[" in text or text.startswith(("function-", "constrained-")):
            break
        path.append(text)
    return path


def from_validation_errors(errors: list[dict], content_type: str = "") -> APIError:
    """Turn FastAPI/pydantic validation errors into one 400 naming the first bad field."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if tuple(first.get("loc", ())) == ("body",) and content_type and "json" not in content_type.lower():
        # FastAPI reads only a JSON content type as JSON: any other one makes even a JSON object "not an object"
        return bad_request(f"The request body must be JSON, sent with Content-Type: application/json "
                           f"(this one was sent as {content_type!r})", code="invalid_content_type")
    loc = _field_path(first.get("loc", ()))
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
    message = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return bad_request(f"Invalid value for '{param}': {message}{more}", param)
