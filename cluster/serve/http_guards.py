"""ASGI middleware that refuses a request before its body is parsed: no API key, too large."""

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.serve.openai_errors import body_too_large, unauthorized


class APIKeyGuard:
    """Every path under ``/v1`` needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_v1(scope):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await unauthorized().response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """A declared Content-Length over the limit gets 413 at once; a body without one (chunked)
    is read here, up to the limit, and handed on whole, so the app never parses a part."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.limit:
                await body_too_large(self.limit).response()(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await body_too_large(self.limit).response()(scope, receive, send)
                return
        await self.app(scope, replay(body, receive), send)


def replay(body: bytes, receive: Receive) -> Receive:
    """The whole body as one message, then the real channel (for http.disconnect)."""
    sent = False

    async def next_message() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return next_message


def is_v1(scope: Scope) -> bool:
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path == "/v1" or path.startswith("/v1/")
