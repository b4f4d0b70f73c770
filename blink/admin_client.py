"""`blinkctl` commands that talk to a gateway's admin API (`gateway/api/admin.py`) with the admin key.

    blinkctl [--url URL] [--admin-key KEY] status | backends | drain ADDR | undrain ADDR | reload | gc
    blinkctl keys list | add NAME [--role R] [--rpm N] [--tpm N] [--max-streams N] [--max-tokens N] | remove NAME

The URL defaults to BLINK_URL or http://127.0.0.1:8000 (the OpenAI base URL, ending in /v1, works too),
the key to BLINK_ADMIN_KEY (without one, blinkctl says so and exits 2). Over HTTPS, `--ssl-ca-certs FILE`
trusts the gateway's CA (else the system's), and `--ssl-certfile/--ssl-keyfile` present a client
certificate to a gateway started with `--ssl-cert-reqs 2`. `keys --file FILE`
edits a keys file directly instead (no gateway needed; running gateways re-read it when it changes).
"""
from __future__ import annotations

import argparse
import json
import os
import ssl
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000"


class AdminError(RuntimeError):
    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    """One admin API call; the parsed JSON reply. Raises AdminError with the gateway's message."""
    url = gateway_root(args.url or os.environ.get("BLINK_URL") or DEFAULT_URL) + path
    key = args.admin_key or os.environ.get("BLINK_ADMIN_KEY", "")
    if not key:
        raise AdminError("no admin key given: pass --admin-key KEY or set BLINK_ADMIN_KEY (the key the gateway "
                         "was started with: `blink serve --admin-key KEY` or BLINK_ADMIN_KEY)", exit_code=2)
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout, context=_tls_context(args, url)) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = err.reason
        raise AdminError(f"{method} {path}: {err.code} {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise AdminError(f"cannot reach the gateway at {url}: {exc}", exit_code=2) from None


def _tls_context(args: argparse.Namespace, url: str) -> ssl.SSLContext | None:
    """For https URLs: trust --ssl-ca-certs (else the system's CAs) and present --ssl-certfile if given."""
    if not url.startswith("https:"):
        return None
    try:
        context = ssl.create_default_context(cafile=getattr(args, "ssl_ca_certs", None))
        if getattr(args, "ssl_certfile", None):
            context.load_cert_chain(args.ssl_certfile, getattr(args, "ssl_keyfile", None))
    except (OSError, ssl.SSLError) as exc:  # the library's reason: never the key
        raise AdminError(f"cannot load the TLS files given to blinkctl: "
                         f"{getattr(exc, 'reason', None) or exc.strerror or type(exc).__name__}", exit_code=2) from None
    return context


def gateway_root(url: str) -> str:
    """The gateway's root URL: the OpenAI base URL (`.../v1`) works too, as clients are given it."""
    url = url.rstrip("/")
    return url[:-len("/v1")] if url.endswith("/v1") else url


def add_admin_commands(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"the gateway, with or without /v1 (default BLINK_URL or {DEFAULT_URL})")
    common.add_argument("--admin-key", help="the admin key (default BLINK_ADMIN_KEY)")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    common.add_argument("--ssl-ca-certs", metavar="FILE", help="https: the CA that signed the gateway's certificate")
    common.add_argument("--ssl-certfile", metavar="FILE", help="https: a client certificate (gateways started "
                        "with --ssl-cert-reqs 2 ask for one)")
    common.add_argument("--ssl-keyfile", metavar="FILE", help="its private key (default: in the certfile)")
    common.add_argument("--json", action="store_true", help="print the gateway's JSON reply")
    sub.add_parser("status", parents=[common], help="uptime, backends, requests in flight").set_defaults(
        func=cmd_status)
    sub.add_parser("backends", parents=[common], help="backends: health, load, KV usage, draining").set_defaults(
        func=cmd_backends)
    for name, helptext in (("drain", "send a backend no new requests"), ("undrain", "route to it again")):
        p = sub.add_parser(name, parents=[common], help=helptext)
        p.add_argument("addr", help="the backend's control address, HOST:PORT")
        p.set_defaults(func=cmd_drain, drain=name == "drain")
    sub.add_parser("reload", parents=[common], help="re-read the gateway's keys file").set_defaults(func=cmd_reload)
    sub.add_parser("gc", parents=[common], help="a full garbage collection now (stops that worker for its length); "
                   "what it found").set_defaults(func=cmd_gc)
    keys = sub.add_parser("keys", help="API keys (hashed in the keys file)").add_subparsers(
        dest="keys_command", required=True)
    file_arg = argparse.ArgumentParser(add_help=False)
    file_arg.add_argument("--file", help="edit this keys file directly instead of calling the gateway")
    keys.add_parser("list", parents=[common, file_arg], help="names, roles, limits").set_defaults(func=cmd_keys_list)
    add = keys.add_parser("add", parents=[common, file_arg], help="create a key; prints it once")
    add.add_argument("name")
    add.add_argument("--role", default="client", choices=("client", "admin", "both"))
    add.add_argument("--rpm", type=int, dest="requests_per_minute", help="requests per minute")
    add.add_argument("--tpm", type=int, dest="tokens_per_minute", help="tokens (prompt + completion) per minute")
    add.add_argument("--max-streams", type=int, help="generations in flight at once")
    add.add_argument("--max-tokens", type=int, dest="max_tokens_per_request",
                     help="completion tokens per request (the stream ends with finish_reason length)")
    add.set_defaults(func=cmd_keys_add)
    remove = keys.add_parser("remove", parents=[common, file_arg], help="delete a key")
    remove.add_argument("name")
    remove.set_defaults(func=cmd_keys_remove)


def _print(args: argparse.Namespace, reply: dict, text: str) -> int:
    print(json.dumps(reply, indent=2) if args.json else text)
    return 0


def _backend_lines(backends: list[dict]) -> list[str]:
    lines = [f"{'backend':24} {'model':24} {'state':9} {'load':>5} {'kv':>5} {'in flight':>9} {'native':>6}"]
    for b in backends:
        state = "draining" if b["draining"] else "stalled" if b["stalled"] else "serving" if b.get("serving") else "down"
        native = b.get("native_stream", "off").split()[0]  # the native stream round (the reason: --json)
        lines.append(f"{b['addr']:24} {b['model']:24} {state:9} {b['load']:5.2f} {b.get('kv_usage', 0):5.2f} "
                     f"{b['in_flight']:9d} {native:>6}")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    r = call(args, "GET", "/admin/status")
    head = [f"uptime {r['uptime_s']:.0f} s, worker {r['worker'] + 1} of {r['workers']} (pid {r['pid']}), "
            f"{r['in_flight']} requests in flight"]
    by_key = ", ".join(f"{k}: {n}" for k, n in r["in_flight_by_key"].items() if n)
    return _print(args, r, "\n".join(head + ([f"in flight by key: {by_key}"] if by_key else [])
                                     + _backend_lines(r["backends"])))


def cmd_backends(args: argparse.Namespace) -> int:
    r = call(args, "GET", "/admin/backends")
    return _print(args, r, "\n".join(_backend_lines(r["backends"])))


def cmd_drain(args: argparse.Namespace) -> int:
    r = call(args, "POST", f"/admin/backends/{'drain' if args.drain else 'undrain'}", {"addr": args.addr})
    return _print(args, r, f"{args.addr}: {'draining' if args.drain else 'serving new requests'}")


def cmd_reload(args: argparse.Namespace) -> int:
    r = call(args, "POST", "/admin/reload")
    return _print(args, r, f"reloaded {r['file'] or '(no keys file)'}: {r['keys']} keys")


def cmd_gc(args: argparse.Namespace) -> int:
    r = call(args, "POST", "/admin/gc")
    found = ", ".join(f"{name} {n}" for name, n in r["by_type"].items())
    return _print(args, r, f"{r['unreachable']} unreachable objects freed in {r['ms']:.1f} ms"
                           + (f": {found}" if found else ""))


def _limits(args: argparse.Namespace) -> dict:
    names = ("requests_per_minute", "tokens_per_minute", "max_streams", "max_tokens_per_request")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def cmd_keys_list(args: argparse.Namespace) -> int:
    if args.file:
        from gateway.policy.keys import KeyStore
        r = {"keys": KeyStore(args.file).listing(), "file": args.file}
    else:
        r = call(args, "GET", "/admin/keys")
    lines = [f"{k['name']:20} {k['role']:7} " + " ".join(f"{n}={v}" for n, v in k["limits"].items())
             for k in r["keys"]]
    return _print(args, r, "\n".join(lines) or "no keys")


def cmd_keys_add(args: argparse.Namespace) -> int:
    if args.file:
        from gateway.policy.keys import KeyLimits, KeysFileError, KeyStore
        try:
            r = {"name": args.name, "key": KeyStore(args.file).add(args.name, args.role, KeyLimits(**_limits(args)))}
        except KeysFileError as exc:
            raise AdminError(str(exc)) from None
    else:
        r = call(args, "POST", "/admin/keys", {"name": args.name, "role": args.role, **_limits(args)})
    return _print(args, r, r["key"])  # the only time the key is shown: the file keeps its hash


def cmd_keys_remove(args: argparse.Namespace) -> int:
    if args.file:
        from gateway.policy.keys import KeyStore
        if not KeyStore(args.file).remove(args.name):
            raise AdminError(f"no key named {args.name!r} in {args.file}")
        r = {"removed": args.name}
    else:
        r = call(args, "DELETE", f"/admin/keys/{args.name}")
    return _print(args, r, f"removed {args.name}")
