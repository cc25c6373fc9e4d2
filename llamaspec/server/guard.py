"""ASGI middleware in front of the routes: who may talk to the server at all, and how requests are counted.

- Host: a browser page can reach a loopback server through DNS rebinding (its own name, re-pointed at 127.0.0.1),
  so the Host header must be an IP address, a localhost name, the name the server was bound to, or one that
  `--allowed-host` adds ('*': any).
- Origin: browsers send it on cross-origin requests; those are refused unless `--cors ORIGIN` allows the origin,
  and then Starlette's CORSMiddleware answers the preflight and adds the CORS headers (as llama.cpp's server and
  Ollama do). Requests without an Origin (curl, SDKs) pass.
- Counting: llamaspec_requests_total{endpoint, status}, with 499 for a client that left before an answer.

Knows nothing about models or about request bodies (the Content-Type check is the app's, where bodies are read).
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from .apierror import APIError
from .metrics import ServerMetrics

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/admin/config",
             "/openapi.json")
LOCAL_NAMES = ("localhost",)


def _host_name(host: str) -> str:
    """'example.com:8080' -> 'example.com', '[::1]:8080' -> '::1' (lower case, no trailing dot)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def normalise_origin(origin: str) -> str:
    parts = urlsplit(origin.strip().lower())
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else origin.strip().lower()


class Guard:
    """Refuses requests whose Host or Origin is not allowed (403 with OpenAI's error JSON)."""

    def __init__(self, app, bound_host: str = "127.0.0.1", allowed_hosts: tuple[str, ...] = (),
                 cors_origins: tuple[str, ...] = ()):
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = {_host_name(h) for h in (bound_host, *allowed_hosts) if h and h != "*"}
        self.any_origin = "*" in cors_origins
        self.origins = {normalise_origin(o) for o in cors_origins if o != "*"}

    def host_allowed(self, host: str | None) -> bool:
        if host is None or self.any_host:
            return True  # HTTP/1.0 clients may send none; browsers always do
        name = _host_name(host)
        return _is_ip(name) or name in LOCAL_NAMES or name.endswith(".localhost") or name in self.hosts

    def origin_allowed(self, origin: str | None) -> bool:
        return origin is None or self.any_origin or normalise_origin(origin) in self.origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for key, value in scope.get("headers", ()):
            headers.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
        host, origin = headers.get("host"), headers.get("origin")
        if not self.host_allowed(host):
            error = APIError(403, f"Host '{host[:100]}' is not allowed (a guard against DNS rebinding); start the "
                                  "server with --allowed-host NAME to accept it", code="host_not_allowed",
                             kind="permission_error")
        elif not self.origin_allowed(origin):
            error = APIError(403, f"cross-origin requests from '{origin[:100]}' are not allowed; start the server "
                                  "with --cors ORIGIN to accept them", code="origin_not_allowed",
                             kind="permission_error")
        else:
            return await self.app(scope, receive, send)
        await error.response()(scope, receive, send)


def cors_options(cors_origins: tuple[str, ...]) -> dict:
    """Starlette CORSMiddleware's settings for the allowed origins."""
    origins = [o if o == "*" else normalise_origin(o) for o in cors_origins]  # browsers send lower case
    return {"allow_origins": origins, "allow_methods": ["GET", "POST", "PATCH", "OPTIONS"],
            "allow_headers": ["Authorization", "Content-Type"], "max_age": 600}


class CountRequests:
    """llamaspec_requests_total{endpoint, status}; 499 when the client left before an answer."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 0}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            status["code"] = status["code"] or 500
            raise
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
            self.metrics.count_request(endpoint, status["code"] or 499)
