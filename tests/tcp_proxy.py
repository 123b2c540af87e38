"""A TCP proxy that makes a network as slow or as broken as a test or benchmark wants: it accepts every connection
at once, holds it until its gate is open (`gated=True`: a store that answers nothing until the test says so) and
then `delay_s` more (a slow network: every new connection pays it), and only then forwards bytes both ways.
`down()` is a server stopped: every open connection is cut and new ones are closed as they arrive, until `up()`
(a server back after a restart, whose clients' pooled connections are all dead).

Used by tests/models/test_uploads.py (gated), benchmarks/upload_stall.py (delayed), tests/lake/
test_postgres_catalog.py and benchmarks/catalog_outage.py (a Postgres catalog stopped and restarted).
"""

from __future__ import annotations

import contextlib
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
        self._up = threading.Event()
        self._up.set()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()  # both ends of every connection being forwarded
        self.refused = 0  # connections closed on arrival while down
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
        if not self._up.is_set():  # a stopped server: the connection ends before a byte is passed
            self._refuse(client)
            return
        with client, socket.create_connection(self.upstream) as up:
            with self._lock:
                if not self._up.is_set():  # went down while this one was connecting
                    self.refused += 1
                    return
                self._open.update((client, up))
            try:
                t = threading.Thread(target=self._pump, args=(up, client), daemon=True)
                t.start()
                self._pump(client, up)
                t.join()
            finally:
                with self._lock:
                    self._open.difference_update((client, up))

    def _refuse(self, client: socket.socket) -> None:
        with self._lock:
            self.refused += 1
        client.close()

    def down(self) -> int:
        """Stop forwarding, as a stopped server does: cut every open connection (both ends, at once) and close new
        ones as they arrive, until `up()`. Returns the connections cut."""
        with self._lock:
            self._up.clear()
            cut, self._open = list(self._open), set()
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv; the owner closes it
        return len(cut) // 2

    def up(self) -> None:
        """Forward new connections again (the server is back; connections cut by `down()` stay dead)."""
        self._up.set()

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
