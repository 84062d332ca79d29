"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every message here is the server's own words about the request; what the server's insides
raised never reaches a body (failures.py turns exceptions into these).
"""

import json
from collections.abc import Sequence
from typing import Any

from fastapi.responses import Response

from cluster.serve.protocol import ErrorInfo, ErrorResponse
from cluster.serve.unsupported_fields import refusal


class APIError(Exception):
    """A request the server refuses; becomes a JSON error body with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.retry_after_s = retry_after_s  # a 503's Retry-After header, in seconds

    def response(self) -> Response:
        headers = None if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}
        return Response(self.body(), status_code=self.status, media_type="application/json",
                        headers=headers)

    def sse_event(self) -> str:
        return f"data: {self.body()}\n\n"

    def body(self) -> str:
        # ASCII with escapes: a message that quotes a client's string (a field's name) stays
        # encodable even when that string is not valid UTF-8
        return json.dumps(ErrorResponse(error=self.info).model_dump(), separators=(",", ":"))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model",
                    code="model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than the limit of {limit} bytes.",
                    code="request_too_large")


def from_validation_errors(errors: Sequence[Any]) -> APIError:
    """FastAPI's 422 list of problems as one 400: malformed JSON, wrong types, and fields
    the body does not declare (those first: they are what the client must change)."""
    extras = [error.get("loc", ())[1:] for error in errors
              if error.get("type") == "extra_forbidden"]
    if extras:
        message, param, code = refusal(extras)
        return bad_request(message, param=param, code=code)
    problems, params = [], []
    for error in errors:
        if error.get("type") == "json_invalid":
            return bad_request(f"The request body is not valid JSON: {error.get('msg')}",
                               code="invalid_json")
        # pydantic names the union member it tried ("str", "list[int]"): not a field
        path = [str(part) for part in error.get("loc", ())[1:] if not is_type_tag(part)]
        params.append(path[0] if path else None)
        problems.append(f"{'.'.join(path)}: {error.get('msg')}" if path else str(error["msg"]))
    message = "; ".join(dict.fromkeys(problems[:4])) or "The request body is invalid."
    return bad_request(message, param=params[0] if params else None, code="invalid_type")


def is_type_tag(part: object) -> bool:
    text = str(part)
    return "[" in text or text in ("str", "int", "float", "bool") or text[:1].isupper()
