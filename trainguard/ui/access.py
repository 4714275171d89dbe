"""Who may read the pages: the ``Host`` header must name this server (DNS rebinding), and
bound beyond loopback every request carries the token; the headers every answer carries."""

from __future__ import annotations

import hmac
import http.cookies
import ipaddress
import socket
import urllib.parse

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
TOKEN_COOKIE = "trainguard_ui_token"
# No script, no frames, nothing fetched from elsewhere: the pages need none of it, and a value
# that escaped its escaping would still run nothing.
SECURITY_HEADERS = (("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; "
                                                 "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
                     ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "no-referrer"),
                     ("Cache-Control", "no-store"))


def is_loopback(addr: str) -> bool:
    if addr.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


class Access:
    """Who may read the pages. The ``Host`` header must name this server (loopback names, the
    bound address, and ``allowed_hosts``; ``*`` allows any): a page on another site that
    rebinds its name to this address gets nothing. With a ``token``, every request must carry
    it (``?token=`` once, then the cookie that answer sets)."""

    def __init__(self, addr: str, *, allowed_hosts=(), token: str | None = None):
        hosts = {*LOOPBACK_NAMES, *(h.strip().lower() for h in allowed_hosts if h.strip())}
        if addr not in ("", "0.0.0.0", "::"):
            hosts.add(addr.strip("[]").lower())
        elif not is_loopback(addr):
            hosts.add(socket.gethostname().lower())
        self.hosts = frozenset(hosts)
        self.token = token

    def host_allowed(self, header: str | None) -> bool:
        if "*" in self.hosts:
            return True
        if not header:
            return False
        host = header.strip().lower()
        host = host[1:].split("]", 1)[0] if host.startswith("[") else host.rsplit(":", 1)[0] if host.count(":") == 1 \
            else host
        return host.rstrip(".") in self.hosts

    def token_given(self, query: str, cookie_header: str | None) -> tuple[bool, bool]:
        """(allowed, came in the query: set the cookie)."""
        if self.token is None:
            return True, False
        given = urllib.parse.parse_qs(query).get("token", [])
        if any(hmac.compare_digest(t.encode(), self.token.encode()) for t in given):
            return True, True
        cookies = http.cookies.SimpleCookie()
        try:
            cookies.load(cookie_header or "")
        except http.cookies.CookieError:
            return False, False
        morsel = cookies.get(TOKEN_COOKIE)
        return morsel is not None and hmac.compare_digest(morsel.value.encode(), self.token.encode()), False
