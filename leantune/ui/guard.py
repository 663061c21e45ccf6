"""Who may talk to the page's server: the checks made on every request before any route runs.

The server runs code and writes files as the user, so it must answer only the page it printed:
- Host: after DNS rebinding, a web page's own name points at 127.0.0.1 and the browser lets that
  page read our answers; the only trace is the Host header. A Host is accepted when it is an IP
  literal, "localhost", or a name the user allowed at start (the bound name, this machine's name,
  --allow-host): a rebinding attacker's name is none of these.
- The session secret: printed in the address (?token=...), kept as a SameSite=Strict HttpOnly
  cookie after the first visit; every request must carry it, so another local user who finds the
  port gets nothing.
- State-changing requests (anything but GET/HEAD) must carry the secret in the X-Leantune-Token
  header, which the page's own script sends and which no plain HTML form on another page can set
  (a cross-origin script would need a CORS preflight this server never grants); and an Origin, when
  sent, must be this server's own.
Comparisons are constant-time on bytes, so a non-ASCII token is refused like any wrong one.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

COOKIE = "leantune_token"
HEADER = "x-leantune-token"
SAFE_METHODS = ("GET", "HEAD")


def cookie_name(host_header: str) -> str:
    """The secret's cookie, one per port: cookies ignore ports, so two pages on one machine would
    otherwise overwrite each other's secret."""
    port = host_header.rsplit(":", 1)[1] if ":" in host_header.rsplit("]", 1)[-1] else "80"
    return f"{COOKIE}_{port}" if port.isdigit() else COOKIE


def host_name(host_header: str) -> str:
    """The name part of a Host header ("127.0.0.1:7860" -> "127.0.0.1", "[::1]:80" -> "::1")."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host_header: str, allowed_names: set[str]) -> bool:
    name = host_name(host_header)
    if not name:
        return False
    if name == "localhost" or name in allowed_names:
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def same_secret(given: str | None, token: str) -> bool:
    return hmac.compare_digest((given or "").encode("utf-8", "surrogateescape"), token.encode())


def origin_matches(origin: str, host_header: str) -> bool:
    """Whether an Origin header names this server as the request reached it (scheme http)."""
    parts = urlsplit(origin)
    return parts.scheme == "http" and parts.netloc.lower() == host_header.strip().lower()


def refusal(method: str, headers, query: dict, cookies: dict, token: str, allowed_names: set[str]) -> str | None:
    """Why this request is refused, or None to let it through."""
    host = headers.get("host", "")
    if not host_allowed(host, allowed_names):
        return f"leantune ui: Host {host!r} is not this page's address (start with --allow-host NAME to use that name)"
    origin = headers.get("origin")
    if origin is not None and not origin_matches(origin, host):
        return "leantune ui: requests from another site are refused"
    if method.upper() in SAFE_METHODS:
        given = query.get("token") or cookies.get(cookie_name(host)) or headers.get(HEADER)
        if not same_secret(given, token):
            return "leantune ui: open the address printed at start (it carries the session's ?token=...)"
        return None
    if not same_secret(headers.get(HEADER), token):
        return "leantune ui: a change needs the page's session secret (X-Leantune-Token); reload the page"
    return None
