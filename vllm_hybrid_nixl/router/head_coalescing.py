"""A response's status line and headers leave in the same TCP write as its first body bytes.

uvicorn writes a response's head as soon as the app sends ``http.response.start`` and its
body with each ``http.response.body``: two writes, two segments on the wire, and a client
woken twice, where the first wake-up brings it nothing to act on. In an exploratory strace of
the router's short-prompt path (2-core VM), the client's wake-up for the bare head delayed
the first token's write by ~1 ms.

:class:`HeadHoldingTransport` wraps the connection's transport: a write that starts a response
head is held until the next write (sent together, in one write) or until the event loop's
next pass, whichever comes first, so a head is never held longer than one pass, and every
other write goes out at once, in order. :func:`head_coalescing_protocol` gives a uvicorn
protocol class the wrapper.
"""

from __future__ import annotations

import asyncio
from typing import Any

RESPONSE_HEAD = b"HTTP/1."


class HeadHoldingTransport(asyncio.Transport):
    """``transport`` with a response head held for the next write (or the loop's next
    pass); everything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport, self._loop = transport, loop
        self._held: bytes | None = None
        self._flush_handle: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is not None:
            data = self._take_held() + bytes(data)
        elif bytes(data[: len(RESPONSE_HEAD)]) == RESPONSE_HEAD:
            self._held = bytes(data)
            self._flush_handle = self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def _take_held(self) -> bytes:
        held, self._held = self._held or b"", None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        return held

    def flush(self) -> None:
        """Writes a held head now (drops it if the connection is closing: nobody reads it)."""
        if self._held is not None:
            held = self._take_held()
            if not self._transport.is_closing():
                self._transport.write(held)

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._take_held()
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()


def head_coalescing_protocol(base: type) -> type:
    """``base`` (a uvicorn HTTP protocol class) writing through :class:`HeadHoldingTransport`."""

    class HeadCoalescingProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(HeadHoldingTransport(transport, self.loop))

    HeadCoalescingProtocol.__name__ = f"HeadCoalescing{base.__name__}"
    return HeadCoalescingProtocol
