"""Ports for tests that must stay what the test needs them to be for as long as it runs.

A port found free and closed again can be taken by other work at any moment (under load it was: another
server, an outgoing connection's local port). `refusing_port()` keeps the port bound instead.
"""

from __future__ import annotations

import socket

_HELD: list[socket.socket] = []  # open until the test process ends


def refusing_port() -> int:
    """A 127.0.0.1 port where connections are refused until this process ends: bound here, never listening, so
    that no server of other work can take it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return s.getsockname()[1]
