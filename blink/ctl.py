"""`blinkctl`: operating a gateway appliance. `blinkctl net apply|check|show` manages its network;
`status`, `backends`, `drain`, `undrain`, `keys`, `reload`, `gc` talk to a gateway's admin API
(`blink/admin_client.py`) with the admin key.

Exit codes: 0 done (or in sync), 1 drift found (`check`), an apply failed (rolled back) or the gateway
refused a call, 2 the profile is invalid or the command cannot run (not root, pyroute2 missing,
gateway unreachable).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from blink.admin_client import AdminError, add_admin_commands
from blink.net.profile import ProfileError, load_profile


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blinkctl", description="operate a blink gateway appliance")
    sub = parser.add_subparsers(dest="command", required=True)
    net = sub.add_parser("net", help="network profiles: links, MTU, addresses, routes, VLANs").add_subparsers(
        dest="net_command", required=True)
    apply = net.add_parser("apply", help="make the system match a profile (rolled back on failure)")
    apply.add_argument("profile")
    apply.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    apply.set_defaults(func=cmd_apply)
    check = net.add_parser("check", help="validate a profile and report drift from it (exit 1 on drift)")
    check.add_argument("profile")
    check.add_argument("--offline", action="store_true", help="validate the file only; do not read the system")
    check.set_defaults(func=cmd_check)
    show = net.add_parser("show", help="links, addresses and routes")
    show.add_argument("--netns", default=None, help="a network namespace (default: this one)")
    show.set_defaults(func=cmd_show)
    add_admin_commands(sub)
    return parser


def cmd_apply(args: argparse.Namespace) -> int:
    from blink.net.apply import ApplyError, apply

    profile = load_profile(args.profile)
    try:
        changes = apply(profile, dry_run=args.dry_run)
    except ApplyError as exc:
        print(f"blinkctl: {exc}", file=sys.stderr)
        return 1
    if not changes:
        print(f"{args.profile}: nothing to change (already applied)")
    for text in changes:
        print(("would " if args.dry_run else "") + text)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    if args.offline:
        print(f"{args.profile}: valid")
        return 0
    from blink.net.apply import apply

    drift = apply(profile, dry_run=True)
    for text in drift:
        print(f"drift: would {text}")
    print(f"{args.profile}: {'in sync' if not drift else f'{len(drift)} change(s) needed'}")
    return 1 if drift else 0


def cmd_show(args: argparse.Namespace) -> int:
    from blink.net.apply import show

    print(show(args.netns))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("BLINK_LOG_LEVEL", "WARNING"), format="%(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except ProfileError as exc:
        print(f"blinkctl: invalid profile: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"blinkctl: {exc.name} is not installed (pip install pyroute2 pyyaml)", file=sys.stderr)
        return 2
    except PermissionError as exc:
        print(f"blinkctl: {exc} (network changes need root or CAP_NET_ADMIN)", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"blinkctl: {exc}", file=sys.stderr)
        return 2
    except AdminError as exc:
        print(f"blinkctl: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
