"""A TCP proxy that makes a network as slow as a test or benchmark wants: it accepts every connection at once,
holds it until its gate is open (`gated=True`: a store that answers nothing until the test says so) and then
`delay_s` more (a slow network: every new connection pays it), and only then forwards bytes both ways.

Used by tests/models/test_uploads.py (gated) and benchmarks/upload_stall.py (delayed).
"""

from __future__ import annotations

import socket
import threading
import time


class TcpProxy:
    """A proxy on 127.0.0.1:`port` to `upstream` (host, port). `reached` is set when the first connection
    arrives; `gate` (set at once unless `gated`) releases the held connections."""

    def __init__(self, upstream: tuple[str, int], *, delay_s: float = 0.0, gated: bool = False):
        if delay_s < 0:
            raise ValueError(f"TcpProxy: delay_s must be >= 0 seconds, got {delay_s!r}")
        self.upstream, self.delay_s = upstream, delay_s
        self.gate, self.reached = threading.Event(), threading.Event()
        if not gated:
            self.gate.set()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self.reached.set()
        self.gate.wait()
        if self.delay_s:
            time.sleep(self.delay_s)  # the slow network itself, not synchronisation
        with client, socket.create_connection(self.upstream) as up:
            t = threading.Thread(target=self._pump, args=(up, client), daemon=True)
            t.start()
            self._pump(client, up)
            t.join()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)  # pass the end of the stream on
            except OSError:
                pass

    def close(self) -> None:
        """Release any held connection and stop accepting new ones."""
        self.gate.set()
        self.sock.close()
