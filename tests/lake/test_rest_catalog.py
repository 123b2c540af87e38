"""An Iceberg REST catalog chosen by $FACTORY_CATALOG_URI=http(s)://... No REST catalog server (Lakekeeper, Polaris,
Nessie: JVM/Rust services) runs here, so what is tested is Factory's side of the protocol against a stdlib HTTP
server on 127.0.0.1 that answers GET /v1/config and GET /v1/{prefix}/namespaces: Factory opens a RestCatalog at that
URI, sends FACTORY_CATALOG_WAREHOUSE and FACTORY_CATALOG_TOKEN, applies the server's config, and names the URI when
nothing (or something else) answers. Creating tables and committing through a real REST catalog is not tested."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pyiceberg.catalog.rest import RestCatalog

from factory.lake import open_catalog
from tests.ports import refusing_port


class _Catalog(BaseHTTPRequestHandler):
    """GET /v1/config (defaults and a `prefix` override, as Lakekeeper and Polaris send) and one namespace list;
    404 for anything else. Records each request's path and Authorization header."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        if self.path.startswith("/v1/config"):
            body = {"defaults": {"factory-test": "default"}, "overrides": {"prefix": "wh-1"}}
        elif self.path == "/v1/wh-1/namespaces":
            body = {"namespaces": [["factory"]]}
        else:
            self.send_error(404)
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def rest_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Catalog)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_rest_uri_opens_a_rest_catalog_there_with_warehouse_and_token(factory_home, rest_server, monkeypatch):
    uri = f"http://127.0.0.1:{rest_server.server_port}"
    monkeypatch.setenv("FACTORY_CATALOG_URI", uri)
    monkeypatch.setenv("FACTORY_CATALOG_WAREHOUSE", "team-wh")
    monkeypatch.setenv("FACTORY_CATALOG_TOKEN", "secret-token")

    catalog = open_catalog(factory_home)
    assert isinstance(catalog, RestCatalog)
    assert catalog.properties["factory-test"] == "default" and catalog.properties["prefix"] == "wh-1"
    assert catalog.list_namespaces() == [("factory",)]  # through the server's prefix, with the token
    assert rest_server.seen == [("/v1/config?warehouse=team-wh", "Bearer secret-token"),
                                ("/v1/wh-1/namespaces", "Bearer secret-token")]
    assert not factory_home.catalog_db.exists()  # no SQLite catalog was made beside it


def test_no_catalog_answering_is_an_error_naming_the_uri(factory_home, monkeypatch):
    port = refusing_port()
    monkeypatch.setenv("FACTORY_CATALOG_URI", f"http://127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match=rf"FACTORY_CATALOG_URI=http://127.0.0.1:{port}: no Iceberg REST "
                                              "catalog answered GET .*/v1/config"):
        open_catalog(factory_home)


def test_a_server_that_is_not_a_rest_catalog_is_an_error_naming_the_uri(factory_home, rest_server, monkeypatch):
    uri = f"http://127.0.0.1:{rest_server.server_port}/not-a-catalog"
    monkeypatch.setenv("FACTORY_CATALOG_URI", uri)
    with pytest.raises(ConnectionError, match=f"FACTORY_CATALOG_URI={uri}: no Iceberg REST catalog answered"):
        open_catalog(factory_home)
    assert [path for path, _ in rest_server.seen] == ["/not-a-catalog/v1/config"]
