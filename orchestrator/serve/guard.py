"""ASGI middleware in front of every route: the API key (header `X-API-Key`, compared in constant
time) and the request body limit (413, before the body is parsed)."""

from __future__ import annotations

import hmac

from fastapi import HTTPException
from fastapi.responses import JSONResponse

# Sent with every refusal: the SDK's HTTP layer retries no answer that carries it.
NO_RETRY = {"x-should-retry": "false"}


class Guard:
    def __init__(self, app, api_key: str | None, max_bytes: int):
        self.app = app
        self.api_key = None if api_key is None else api_key.encode()
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        checked = self.api_key is not None and scope["path"] != "/api/v1/healthz"
        if checked and not hmac.compare_digest(headers.get(b"x-api-key", b""), self.api_key):
            response = JSONResponse({"detail": "X-API-Key: missing or not this service's key"}, 401, NO_RETRY)
            return await response(scope, receive, send)
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            response = JSONResponse({"detail": self._too_large(int(declared))}, 413, NO_RETRY)
            return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self._too_large(received), NO_RETRY)
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self, size: int) -> str:
        return f"request body: expected at most {self.max_bytes} bytes, found {size}; send fewer or shorter data"
