"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every message here is the server's own words about the request; what the server's insides
raised never reaches a body (failures.py turns exceptions into these). Every error has a
``code`` that names the problem, so a client can tell them apart without parsing messages.
"""

import json
from collections.abc import Sequence
from typing import Any

from fastapi.responses import Response

from cluster.serve.protocol import ErrorInfo, ErrorResponse
from cluster.serve.unsupported_fields import refusal


class APIError(Exception):
    """A request the server refuses; becomes a JSON error body with this HTTP status."""

    def __init__(self, status: int, message: str, *, code: str,
                 type: str = "invalid_request_error", param: str | None = None,
                 retry_after_s: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.retry_after_s = retry_after_s  # a 503's Retry-After header, in seconds
        self.headers = headers or {}  # any other (a 405's Allow)

    def response(self) -> Response:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return Response(self.body(), status_code=self.status, media_type="application/json",
                        headers=headers)

    def sse_event(self) -> str:
        return f"data: {self.body()}\n\n"

    def body(self) -> str:
        # ASCII with escapes: a message that quotes a client's string (a field's name) stays
        # encodable even when that string is not valid UTF-8
        return json.dumps(ErrorResponse(error=self.info).model_dump(), separators=(",", ":"))


def bad_request(message: str, param: str | None = None, *, code: str) -> APIError:
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
            where = error.get("loc", ())[1:]
            detail = (error.get("ctx") or {}).get("error") or error.get("msg")
            at = f" (at character {where[0]})" if where else ""
            return bad_request(f"The request body is not valid JSON: {detail}{at}.",
                               code="invalid_json")
        # pydantic names the union member it tried ("str", "list[int]"): not a field
        path = [str(part) for part in error.get("loc", ())[1:] if not is_type_tag(part)]
        if not path and error.get("type") == "missing":
            return bad_request("The request body is empty: send a JSON object.",
                               code="missing_body")
        params.append(path[0] if path else None)
        problems.append(f"{'.'.join(path)}: {error.get('msg')}" if path else str(error["msg"]))
    message = "; ".join(dict.fromkeys(problems[:4])) or "The request body is invalid."
    missing = all(error.get("type") == "missing" for error in errors)
    return bad_request(message, param=params[0] if params else None,
                       code="missing_required_parameter" if missing else "invalid_type")


def invalid_utf8(error: UnicodeDecodeError) -> APIError:
    """The body's bytes are not UTF-8 text (JSON's encoding), before any JSON is parsed."""
    return bad_request(f"The request body is not valid UTF-8: byte "
                       f"0x{error.object[error.start]:02x} at position {error.start} "
                       f"({error.reason}).", code="invalid_utf8")


def from_http_error(status: int, detail: str, method: str, path: str,
                    headers: dict[str, str] | None = None) -> APIError:
    """Starlette's and FastAPI's own refusals (a path or method the app does not have, a body
    it could not read), in OpenAI's shape, with a code (``http_<status>`` for any other)."""
    path = path if len(path) <= 200 else path[:200] + "..."  # the client's: quoted, not all
    if status == 404:
        return APIError(404, f"Invalid URL ({method} {path}): no such route.",
                        type="not_found_error", code="unknown_url")
    if status == 405:
        allowed = (headers or {}).get("allow", (headers or {}).get("Allow", ""))
        return APIError(405, f"Method {method} is not allowed for {path} (allowed: "
                        f"{allowed or 'none'}).", code="method_not_allowed", headers=headers)
    if status == 400:
        return bad_request("The request body could not be read as JSON.", code="invalid_body")
    return APIError(status, detail, code=f"http_{status}", headers=headers)


def is_type_tag(part: object) -> bool:
    text = str(part)
    return "[" in text or text in ("str", "int", "float", "bool") or text[:1].isupper()
