"""A tiny HTTP service for supervisor tests: /health, /echo?x=, /hang (hangs once, then answers), and /crash (says
why on stderr and exits with code 3, like a service hitting a fatal bug on a poisoned request)."""

import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

PORT, MARKER = int(sys.argv[1]), Path(sys.argv[2])
forever = threading.Event()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        url = urlparse(self.path)
        if url.path == "/crash":
            sys.stderr.write("Traceback (most recent call last):\n"
                             f"RuntimeError: poisoned request in pid {os.getpid()}\n")
            sys.stderr.flush()
            os._exit(3)
        if url.path == "/hang" and not MARKER.exists():
            MARKER.write_text("hanging")  # the test kills us once it sees this
            forever.wait()
        body = {"/health": b"ok", "/hang": b"answered"}.get(url.path, parse_qs(url.query).get("x", [""])[0].encode())
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
