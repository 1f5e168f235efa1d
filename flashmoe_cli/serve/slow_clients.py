"""Connections that never finish a request are closed (slowloris).

uvicorn times out a connection left idle between requests (keep-alive, 5 s), but not one that
opens and sends nothing, or sends a request's headers a byte at a time: each such connection held
a descriptor for ever, and at the process's descriptor limit nobody was served (issue 41). Here a
connection must deliver a request's headers within `read_timeout` seconds of opening or of the
request's first byte, or it is closed; the body then has `read_timeout` seconds of its own
(limits.read_body). The protocol is h11's (uvicorn's pure-Python one, always: the same behaviour
whatever else is installed).
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class _Timed(H11Protocol):
    read_timeout = 30.0
    _request_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request's first bytes, its headers not complete yet
            if self._request_timer is None and not self.transport.is_closing():
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._request_timer = self.loop.call_later(self.read_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _too_slow(self) -> None:
        self._request_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol(read_timeout: float) -> type:
    """uvicorn's `http` protocol class with this timeout."""
    return type("TimedH11Protocol", (_Timed,), {"read_timeout": read_timeout})
