"""Running the app: a listening socket bound before the model loads, uvicorn with a header deadline per
connection and a cap on open connections below the descriptor limit, and a shutdown that lets in-flight requests
finish (Service.begin_shutdown)."""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Callable

from starlette.applications import Starlette

from .app import Service


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port); binding first lets the caller print the real port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that do, and with Nagle on a
    # keep-alive client waits ~40 ms (a delayed ACK) for every response body
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def connection_limits() -> tuple[int, int]:
    """(open connections allowed, connections accepted per wake-up) below the process's file-descriptor limit:
    past it, accept() fails with EMFILE and no client at all gets in. asyncio accepts up to a batch of
    connections before any of them reaches the protocol (a few loop turns later), so the cap leaves room for
    three batches beside the models, logs and the listening socket."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = 1 << 16 if soft == resource.RLIM_INFINITY else soft
    batch = max(min(soft // 16, 64), 1)
    return max(soft - max(64, soft // 8) - 3 * batch, 8), batch


_REFUSED_BODY = (b'{"error": {"message": "too many open connections", "type": "server_error", "param": null, '
                 b'"code": null}}')
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))


class OncePer(logging.Filter):
    """Lets a log record whose message contains `marker` through at most once per `seconds` (asyncio logs a
    traceback for every failed accept() while the descriptors are exhausted: 58 MB in 40 s)."""

    def __init__(self, marker: str, seconds: float = 10.0):
        super().__init__()
        self.marker, self.seconds, self._last = marker, seconds, -float("inf")

    def filter(self, record: logging.LogRecord) -> bool:
        if self.marker not in record.getMessage() and not (
                record.exc_info and self.marker in str(record.exc_info[1])):
            return True
        now = time.monotonic()
        if now - self._last < self.seconds:
            return False
        self._last = now
        return True


def _no_cancelled_traceback(record: logging.LogRecord) -> bool:
    """False for a cancelled task's traceback (Starlette reports its lifespan's as the message text)."""
    if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
        return False
    text = str(record.msg)
    return not (text.startswith("Traceback") and text.rstrip().endswith("CancelledError"))


def _protocol_with_header_timeout(timeout: float, cap: int):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request has not fully arrived `timeout` seconds
    after it opened (or after the previous answer) while nothing is being answered. uvicorn has no such limit:
    a client sending nothing, or one byte a minute, would hold its socket forever. The body's own deadline is
    read_json's (408). At most `cap` connections stay open: a new one past it closes the oldest that has not
    finished sending its request's headers (a stalled client; a real one sends them at once), or, when every
    open connection is in a request, is answered 503."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    opened: dict = {}   # open connections, oldest first

    class Protocol(H11Protocol):
        _deadline = None

        def _idle(self) -> bool:
            answering = self.cycle is not None and not self.cycle.response_complete
            return not answering and self.conn.their_state == h11.IDLE

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            answering = self.cycle is not None and not self.cycle.response_complete
            if not answering and self.conn.their_state in (h11.IDLE, h11.SEND_BODY) \
                    and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            opened[self] = None
            if len(opened) > cap:
                oldest = next((p for p in opened if p is not self and p._idle()), None)
                if oldest is None:
                    opened.pop(self, None)
                    transport.write(_REFUSED)
                    transport.close()
                    return
                opened.pop(oldest, None)
                oldest.transport.close()
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            opened.pop(self, None)
            self._disarm()
            super().connection_lost(exc)

    return Protocol


def serve(app: Starlette, sock: socket.socket, shutdown_timeout: float = 10.0, access_log: bool = False,
          on_ready: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests get `shutdown_timeout` seconds to finish, then are cancelled
    (streams end with a finish chunk and [DONE]). Returns normally after a signal (the caller exits 0).
    `on_ready` runs once requests are being accepted and the signal handlers are in place."""
    import signal

    import uvicorn

    service: Service = app.state.service

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_ready is not None and not self.should_exit:
                on_ready()

        signals = 0

        def handle_exit(self, sig, frame):
            # the first signal stops taking requests, the second cuts the running one (its client still gets a
            # final chunk or an error); only a third is uvicorn's force quit, which drops open answers
            service.begin_shutdown(shutdown_timeout)
            self.signals += 1
            if self.signals <= 2:
                self.should_exit = True
            else:
                super().handle_exit(sig, frame)

    cap, batch = connection_limits()
    # uvicorn's own deadline is only a backstop: our cancellation ends requests cleanly before it
    config = uvicorn.Config(app, log_level="info" if access_log else "warning", access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout + 5.0, lifespan="on",
                            http=_protocol_with_header_timeout(service.config.read_timeout, cap), backlog=batch)
    logging.getLogger("asyncio").addFilter(OncePer("Too many open files"))
    # a third signal is uvicorn's force quit, which cancels the app's lifespan task: not an error worth a traceback
    logging.getLogger("uvicorn.error").addFilter(_no_cancelled_traceback)
    # uvicorn re-raises the signal that stopped it once it has shut down, through the handlers it found: make
    # those no-ops so that a signal ends the process normally.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    _Server(config).run(sockets=[sock])
