"""What a web page may make this server do: the Host check (DNS rebinding) and the Origin check
(a cross-site POST).

A browser lets any page POST to any address without asking first when the request is "simple"
(a form's or `text/plain` body, no custom header), and this server reads every body as JSON
whatever its Content-Type (Ollama's clients and `curl -d` send none, or a form's), so a page on
another site could make it generate. The browser names the page in `Origin`; a request whose
Origin is not allowed is refused before it reaches a route. Clients that are not browsers send
no Origin and are not concerned.

Owns: `HostCheck` (403 for a Host header that names another site) and `OriginCheck` (403 for an
Origin this server does not trust: allowed are the page's own origin (same scheme-less host and
port as the Host header: the chat page), loopback origins on any port, Ollama's defaults for
desktop apps and editors, the `--cors-origin`s and the `--allowed-origin`s).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from mlxkv.server.errors import error_response
from mlxkv.server.middleware import printable

# Names every server answers to, whatever address it is bound to.
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# Schemes of pages that run on this machine (Ollama's OLLAMA_ORIGINS defaults: Electron and
# Tauri apps, local files, VS Code's webviews).
_LOCAL_SCHEMES = ("app", "file", "tauri", "vscode-webview", "vscode-file")


class HostCheck:
    """Answers only requests whose Host header names this server: a loopback name, the address
    it is bound to, or one of `allowed_hosts` ("*" for any). Without it a web page could drive
    the API through DNS rebinding (its own name resolving to 127.0.0.1) with the browser's
    same-origin checks satisfied. A server bound to every address (0.0.0.0, ::) is reached by
    names it cannot know, so it checks nothing unless `allowed_hosts` says otherwise.
    """

    def __init__(self, app: ASGIApp, bound_host: str, allowed_hosts: tuple[str, ...] = ()):
        self.app = app
        self._any = "*" in allowed_hosts or (not allowed_hosts and _is_wildcard(bound_host))
        self._names = {_host_name(n) for n in (*_LOOPBACK_NAMES, bound_host, *allowed_hosts)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._any:
            await self.app(scope, receive, send)
            return
        host = _header(scope, b"host")
        if _host_name(host) in self._names:
            await self.app(scope, receive, send)
            return
        response = error_response(
            scope,
            403,
            f"this server does not answer to the host {printable(host)[:100]!r}; add it with "
            "--allowed-host if it is yours",
            code="host_not_allowed",
        )
        await response(scope, receive, send)


class OriginCheck:
    """Refuses (403, in the API's shape) a request from a browser page this server does not
    trust: one whose `Origin` is neither the server's own, nor a loopback page, nor a local
    app's, nor one of `allowed_origins` ("*" for any; exact origins such as
    `https://chat.example.com`, compared without case). `null` (a sandboxed frame, a page
    redirected across sites) is refused unless allowed by name.
    """

    def __init__(self, app: ASGIApp, allowed_origins: tuple[str, ...] = ()):
        self.app = app
        self._any = "*" in allowed_origins
        self._origins = {origin.strip().lower().rstrip("/") for origin in allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = _header(scope, b"origin") if scope["type"] == "http" else ""
        if not origin or self._any or self._trusts(origin, _header(scope, b"host")):
            await self.app(scope, receive, send)
            return
        response = error_response(
            scope,
            403,
            f"requests from the web page {printable(origin)[:100]!r} are not allowed; if you "
            "trust it, start the server with --allowed-origin ORIGIN",
            code="origin_not_allowed",
        )
        await response(scope, receive, send)

    def _trusts(self, origin: str, host: str) -> bool:
        origin = origin.strip().lower()
        if origin in self._origins:
            return True
        try:
            parts = urlsplit(origin)
            hostname = parts.hostname or ""
        except ValueError:  # an unclosed IPv6 bracket
            return False
        if parts.scheme in _LOCAL_SCHEMES:
            return True
        if parts.scheme not in ("http", "https"):
            return False
        return hostname in _LOOPBACK_NAMES or parts.netloc == host.strip().lower()


def _header(scope: Scope, name: bytes) -> str:
    return dict(scope["headers"]).get(name, b"").decode("latin-1")


def _host_name(host: str) -> str:
    """The name in a Host header (or an address), lower case, without port or brackets."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8080
        return host[1:].partition("]")[0]
    if host.count(":") == 1:  # name:port
        return host.partition(":")[0]
    return host  # a name, or a bare IPv6 address


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(_host_name(host)).is_unspecified
    except ValueError:
        return host == ""
