"""`leantune ui [--host 127.0.0.1] [--port 7860] [--runs DIR]`: the local web page.

Bound to localhost by default. Bound anywhere else, anyone who can reach the port could start
processes and write captions, so the server then requires a random token (printed in the address)
and says so with a warning. Needs the `ui` extra (FastAPI, uvicorn), imported only here.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

def is_local(host: str) -> bool:
    """Whether binding `host` keeps the page on this machine (localhost or any loopback address)."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False          # a host name: it may resolve to an outside address


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--runs", default="leantune-runs", help="folder of the page's runs (default: leantune-runs)")
    p.add_argument("--token", default=None, help="access token (default: none on localhost, random elsewhere)")


def address(host: str, port: int, token: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def run(args: argparse.Namespace) -> int:
    from ..config import ConfigError

    try:
        from .app import serve
    except ImportError as e:
        raise ConfigError(f"leantune ui needs FastAPI and uvicorn ({e.name} is missing): "
                          f"pip install 'leantune[ui]'") from None
    token = args.token
    if not is_local(args.host):
        token = token or secrets.token_urlsafe(16)
        print(f"warning: leantune ui is bound to {args.host}, reachable from other machines; anyone with the "
              f"address below can start runs and write files as this user", file=sys.stderr)
    print(f"leantune ui: {address(args.host, args.port, token)}  (runs in {Path(args.runs).resolve()})", flush=True)
    serve(Path(args.runs), args.host, args.port, token)
    return 0
