"""An Iceberg REST catalog (Lakekeeper, Polaris, Nessie, Gravitino, ...) chosen by FACTORY_CATALOG_URI=http(s)://...

pyiceberg's RestCatalog at that URI, with FACTORY_CATALOG_WAREHOUSE (the server's warehouse name or location, sent
with GET /v1/config), FACTORY_CATALOG_TOKEN (a bearer token) or FACTORY_CATALOG_CREDENTIAL (`client_id:secret`
for the OAuth2 client-credentials flow), and the AWS_* S3 settings (factory/objstore.py) for servers that do not
vend storage credentials. Tested against a stdlib HTTP server on 127.0.0.1 that answers GET /v1/config only (the
handshake and what Factory sends); no real REST catalog server runs in the tests, so table commits through one
are untested. pyiceberg 0.12 sets no HTTP timeout: a server that accepts the connection and never answers hangs
the open.
"""

from __future__ import annotations

import os

import requests
from pyiceberg.catalog.rest import RestCatalog
from pyiceberg.exceptions import RESTError

from factory.objstore import iceberg_io_properties

REST_SCHEMES = frozenset({"http", "https"})
WAREHOUSE_ENV = "FACTORY_CATALOG_WAREHOUSE"
TOKEN_ENV = "FACTORY_CATALOG_TOKEN"
CREDENTIAL_ENV = "FACTORY_CATALOG_CREDENTIAL"


def open_rest_catalog(name: str, uri: str, setting: str) -> RestCatalog:
    """A RestCatalog at `uri` configured from the environment; a ConnectionError naming `setting`, the URI and the
    cause when no REST catalog answers its GET /v1/config."""
    props = iceberg_io_properties()
    props["uri"] = uri.rstrip("/")
    for env, prop in ((WAREHOUSE_ENV, "warehouse"), (TOKEN_ENV, "token"), (CREDENTIAL_ENV, "credential")):
        if value := os.environ.get(env):
            props[prop] = value
    try:
        return RestCatalog(name, **props)
    except (requests.RequestException, RESTError, ValueError) as e:
        # ValueError: a 200 whose body is not a catalog config (pydantic), i.e. some other web server.
        raise ConnectionError(f"{setting}={uri}: no Iceberg REST catalog answered GET {props['uri']}/v1/config "
                              f"({type(e).__name__}: {e})") from e
