"""Running the app: a listening socket bound before the model loads, uvicorn with a header deadline per
connection, and a shutdown that lets in-flight requests finish (Service.begin_shutdown)."""
from __future__ import annotations

import socket
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


def _protocol_with_header_timeout(timeout: float):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request has not fully arrived `timeout` seconds
    after it opened (or after the previous answer) while nothing is being answered. uvicorn has no such limit:
    a client sending nothing, or one byte a minute, would hold its socket forever. The body's own deadline is
    read_json's (408)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _deadline = None

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
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
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

    # uvicorn's own deadline is only a backstop: our cancellation ends requests cleanly before it
    config = uvicorn.Config(app, log_level="info" if access_log else "warning", access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout + 5.0, lifespan="on",
                            http=_protocol_with_header_timeout(service.config.read_timeout))
    # uvicorn re-raises the signal that stopped it once it has shut down, through the handlers it found: make
    # those no-ops so that a signal ends the process normally.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    _Server(config).run(sockets=[sock])
