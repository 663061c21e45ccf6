"""`leantune ui [--host 127.0.0.1] [--port 7860] [--runs DIR] [--data DIR ...]`: the local web page.

The page starts processes and writes files as the user, so it answers only whoever holds the
address it prints: that address carries a random per-session secret, on localhost too (another
user of a shared machine can reach 127.0.0.1). Datasets are confined to the --data folders (default:
the folder the command runs in) and runs to --runs. Bound beyond localhost it also warns. Host and
Origin checks (ui/guard.py) keep other web pages out. Needs the `ui` extra (FastAPI, uvicorn),
imported only here.
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
    p.add_argument("--data", action="append", default=None, metavar="DIR",
                   help="a folder datasets may be read from and written to (repeatable; default: the current folder)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a host name the page may be reached by, beyond IP addresses and localhost")
    p.add_argument("--token", default=None, help="the session secret (default: a new random one each start)")


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
    token = args.token or secrets.token_urlsafe(16)
    data_roots = [Path(d).expanduser().resolve() for d in (args.data or [Path.cwd()])]
    for root in data_roots:
        if not root.is_dir():
            raise ConfigError(f"--data {root}: not a folder")
    allowed = set(args.allow_host)
    if not is_local(args.host):
        import socket

        allowed |= {args.host, socket.gethostname(), socket.getfqdn()}
        print(f"warning: leantune ui is bound to {args.host}, reachable from other machines; anyone with the "
              f"address below can start runs and write files as this user", file=sys.stderr)
    print(f"leantune ui: {address(args.host, args.port, token)}  (runs in {Path(args.runs).resolve()}; "
          f"datasets under {', '.join(map(str, data_roots))})", flush=True)
    serve(Path(args.runs), args.host, args.port, token, data_roots, allowed)
    return 0
