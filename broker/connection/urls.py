"""A client's URL (``url_of``: the URL a process reopens it from, TLS settings in its query), the settings a URL
cannot carry (``uncarried``), and URLs with their passwords hidden, for messages (``redact``)."""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import redis
from redis.cluster import RedisCluster

from broker.connection.client import Client
from broker.connection.sockets import _BOUNDED


def url_of(client: Client) -> str | None:
    """A URL reopening ``client``'s server, or None for clients that have none (fakeredis, custom pools).

    For a cluster client, the URL of one of its nodes: opening it finds the others (see ``connect``).
    """
    if isinstance(client, RedisCluster):
        node = client.get_default_node() or next(iter(client.get_primaries()), None)
        return None if node is None or node.redis_connection is None else url_of(node.redis_connection)
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    cls = {bounded: plain for plain, bounded in _BOUNDED.items()}.get(pool.connection_class, pool.connection_class)
    if cls is redis.UnixDomainSocketConnection:
        url = f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
        auth = _auth(kwargs)
        return url.replace("unix://", f"unix://{auth}", 1)
    if cls in (redis.Connection, redis.SSLConnection) and "host" in kwargs:
        scheme, query = ("rediss", _tls_query(kwargs)) if cls is redis.SSLConnection else ("redis", "")
        return f"{scheme}://{_auth(kwargs)}{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}{query}"
    return None


#: How each TLS setting of a client that is not redis-py's default goes into a URL: redis-py's
#: ``from_url`` reads these query arguments back (strings as they are, the rest through its parsers).
_CERT_REQS = {ssl.CERT_NONE: "none", ssl.CERT_OPTIONAL: "optional", ssl.CERT_REQUIRED: "required"}
_TLS_QUERY: dict[str, Callable[[Any], str | None]] = {
    "ssl_ca_certs": lambda v: None if v is None else os.fspath(v),
    "ssl_ca_path": lambda v: None if v is None else os.fspath(v),
    "ssl_certfile": lambda v: None if v is None else os.fspath(v),
    "ssl_keyfile": lambda v: None if v is None else os.fspath(v),
    "ssl_password": lambda v: v,
    "ssl_cert_reqs": lambda v: None if (name := "none" if v is None else _CERT_REQS.get(v, v)) == "required" else name,
    "ssl_check_hostname": lambda v: None if v or v is None else "false",
    "ssl_min_version": lambda v: None if v is None else str(int(v)),
    "ssl_ciphers": lambda v: v,
    "ssl_include_verify_flags": lambda v: ",".join(flag.name for flag in v) if v else None,
    "ssl_exclude_verify_flags": lambda v: ",".join(flag.name for flag in v) if v else None,
}

#: TLS settings (and how a client authenticates) that a URL cannot carry, and what each is when unset.
_NOT_IN_URLS = {"ssl_ca_data": None, "ssl_ocsp_context": None, "ssl_ocsp_expected_cert": None,
                "ssl_validate_ocsp": False, "ssl_validate_ocsp_stapled": False, "credential_provider": None}


def _tls_query(kwargs: dict[str, Any]) -> str:
    """The query of a ``rediss://`` URL carrying the client's TLS settings (empty if all are defaults)."""
    pairs = [(name, text) for name, carry in _TLS_QUERY.items() if (text := carry(kwargs.get(name))) is not None]
    return "?" + "&".join(f"{name}={quote(str(text), safe='/:,')}" for name, text in pairs) if pairs else ""


def uncarried(client: Client) -> list[str]:
    """The settings of ``client`` that the URL ``url_of`` gives cannot carry: a CA in memory
    (``ssl_ca_data``), OCSP checks, a credential provider. A process reopening that URL would connect
    without them (and fail the certificate check, or the password)."""
    if isinstance(client, RedisCluster):
        node = client.get_default_node() or next(iter(client.get_primaries()), None)
        return [] if node is None or node.redis_connection is None else uncarried(node.redis_connection)
    kwargs = client.connection_pool.connection_kwargs
    return [name for name, unset in _NOT_IN_URLS.items() if kwargs.get(name, unset) not in (unset, None)]


def _auth(kwargs: dict[str, Any]) -> str:
    user, password = kwargs.get("username"), kwargs.get("password")
    if not password:
        return ""
    return f"{quote(user or '', safe='')}:{quote(password, safe='')}@"


def redact(url: str) -> str:
    """``url`` with any password hidden (the user's, and a TLS key's ``ssl_password``), for messages."""
    url = re.sub(r"([?&]ssl_password=)[^&]*", r"\1***", url)
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
