"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse

from cluster.serve.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """A request the server refuses; becomes a JSON error body with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)

    def sse_event(self) -> str:
        return f"data: {ErrorResponse(error=self.info).model_dump_json()}\n\n"


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


def internal_error(error: BaseException) -> APIError:
    return APIError(500, f"{type(error).__name__}: {cause_message(error)}", type="server_error")


def unavailable(error: BaseException) -> APIError:
    return APIError(503, cause_message(error), type="service_unavailable")


def cause_message(error: BaseException) -> str:
    """The original message, also for errors raised inside a Ray actor (RayTaskError)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException) and cause is not error:
        return cause_message(cause)
    return str(error).strip() or type(error).__name__


def from_validation_errors(errors: Sequence[Any]) -> APIError:
    """FastAPI's 422 list of problems as one 400: malformed JSON and wrong types."""
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
