"""Applying a network profile (blink/net/profile.py) to the kernel with pyroute2.

`plan()` compares the profile with the live state and returns the steps that would change it, each
with its undo; an empty plan means the profile is already applied (so applying twice changes nothing
the second time). `apply()` runs the steps in order and, when one fails, undoes the ones before it in
reverse order, so a failed apply leaves the system as it found it.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from .profile import LinkSpec, Profile, ProfileError, RouteSpec

log = logging.getLogger("blink.net")

MAIN_TABLE = 254
IFF_UP = 1


class ApplyError(RuntimeError):
    """A step failed; the message says which, and what the rollback did."""


@dataclass(frozen=True)
class LinkState:
    index: int
    name: str
    kind: str  # "" for a physical link
    mtu: int
    up: bool


@dataclass(frozen=True)
class RouteState:
    dst: ipaddress.IPv4Network | ipaddress.IPv6Network
    via: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    oif: int | None
    metric: int


@dataclass
class NetState:
    links: dict[str, LinkState] = field(default_factory=dict)
    addresses: dict[int, set] = field(default_factory=dict)  # link index -> {ip_interface}
    routes: list[RouteState] = field(default_factory=list)  # main table

    def link_name(self, index: int | None) -> str:
        return next((l.name for l in self.links.values() if l.index == index), "-")


@dataclass(frozen=True)
class Step:
    text: str
    do: Callable
    undo: Callable | None = None  # None: nothing to undo (or undone by an earlier step's undo)


# ---------------------------------------------------------------- reading the kernel
@contextmanager
def open_netns(netns: str | None):
    from pyroute2 import IPRoute

    ipr = IPRoute(netns=netns, flags=0) if netns else IPRoute()  # flags=0: never create a namespace
    try:
        yield ipr
    finally:
        ipr.close()


def netns_exists(name: str) -> bool:
    """A named namespace (`ip netns add`): its file under /run/netns (or /var/run/netns), else pyroute2's list."""
    from pyroute2 import netns

    if any(os.path.exists(os.path.join(d, name)) for d in ("/run/netns", "/var/run/netns")):
        return True
    return name in netns.listnetns()


def read_state(ipr) -> NetState:
    state = NetState()
    for msg in ipr.get_links():
        name = msg.get("ifname")
        state.links[name] = LinkState(msg["index"], name, msg.get(("linkinfo", "kind")) or "", msg.get("mtu"),
                                      bool(msg["flags"] & IFF_UP))
    for msg in ipr.get_addr():
        state.addresses.setdefault(msg.get("index"), set()).add(
            ipaddress.ip_interface(f"{msg.get('address')}/{msg['prefixlen']}"))
    for family in (socket.AF_INET, socket.AF_INET6):
        for msg in ipr.get_routes(family=family, table=MAIN_TABLE):
            zero = "0.0.0.0" if family == socket.AF_INET else "::"
            dst = ipaddress.ip_network(f"{msg.get('dst') or zero}/{msg['dst_len']}", strict=False)
            via = msg.get("gateway")
            state.routes.append(RouteState(dst, ipaddress.ip_address(via) if via else None, msg.get("oif"),
                                           msg.get("priority") or 0))
    return state


def _index(ipr, name: str) -> int:
    found = ipr.link_lookup(ifname=name)
    if not found:
        raise ApplyError(f"link {name} vanished while applying")
    return found[0]


# ---------------------------------------------------------------- planning
def plan(profile: Profile, state: NetState) -> list[Step]:
    """The steps that make `state` match `profile` (empty when it already does). Raises ProfileError."""
    steps: list[Step] = []
    for i, link in enumerate(profile.links):
        steps += _plan_link(profile, state, link, f"links[{i}]")
    for i, addr in enumerate(profile.addresses):
        _check_link_known(profile, state, addr.link, f"addresses[{i}].link")
        cur = state.links.get(addr.link)
        if cur is None or addr.address not in state.addresses.get(cur.index, set()):
            steps.append(_add_address(addr.link, addr.address))
    for i, route in enumerate(profile.routes):
        if route.dev is not None:
            _check_link_known(profile, state, route.dev, f"routes[{i}].dev")
        steps += _plan_route(state, route)
    return steps


def _check_link_known(profile: Profile, state: NetState, name: str, where: str) -> None:
    if name not in state.links and profile.link(name) is None:
        raise ProfileError(f"{where}: no link named {name!r} (neither present nor created by the profile)")


def _plan_link(profile: Profile, state: NetState, link: LinkSpec, where: str) -> list[Step]:
    cur = state.links.get(link.name)
    steps = []
    if cur is None:
        if link.kind == "existing":
            raise ProfileError(f"{where}.name: no link named {link.name!r}{_in(profile)}")
        steps.append(_create_link(profile, state, link, where))
    elif link.kind != "existing" and cur.kind != link.kind:
        raise ProfileError(f"{where}.kind: {link.name} exists as a {cur.kind or 'physical'} link, not {link.kind}")
    if link.mtu is not None and (cur is None or cur.mtu != link.mtu):
        steps.append(_set_link(link.name, f"set {link.name} mtu {cur.mtu if cur else 'default'} -> {link.mtu}",
                               {"mtu": link.mtu}, {"mtu": cur.mtu} if cur else None))
    if link.state is not None and (cur is None or cur.up != (link.state == "up")):
        old = ("up" if cur.up else "down") if cur else None
        steps.append(_set_link(link.name, f"set {link.name} {link.state}", {"state": link.state},
                               {"state": old} if old else None))
    return steps


def _create_link(profile: Profile, state: NetState, link: LinkSpec, where: str) -> Step:
    if link.kind == "veth":
        if link.peer in state.links:
            raise ProfileError(f"{where}.peer: a link named {link.peer!r} already exists{_in(profile)}")
        if link.peer_netns is not None and not netns_exists(link.peer_netns):
            raise ProfileError(f"{where}.peer_netns: no network namespace named {link.peer_netns!r}")

        def do(ipr):
            ipr.link("add", ifname=link.name, kind="veth", peer=link.peer)
            if link.peer_netns is not None:
                ipr.link("set", index=_index(ipr, link.peer), net_ns_fd=link.peer_netns)
        text = f"create veth {link.name} <-> {link.peer}" + (f" (in netns {link.peer_netns})" if link.peer_netns else "")
    else:
        _check_link_known(profile, state, link.parent, f"{where}.parent")

        def do(ipr):
            ipr.link("add", ifname=link.name, kind="vlan", link=_index(ipr, link.parent), vlan_id=link.vlan_id)
        text = f"create vlan {link.name} (id {link.vlan_id} on {link.parent})"
    return Step(text, do, lambda ipr: ipr.link("del", index=_index(ipr, link.name)))


def _set_link(name: str, text: str, new: dict, old: dict | None) -> Step:
    undo = (lambda ipr: ipr.link("set", index=_index(ipr, name), **old)) if old else None
    return Step(text, lambda ipr: ipr.link("set", index=_index(ipr, name), **new), undo)


def _add_address(link: str, address) -> Step:
    def call(op):
        return lambda ipr: ipr.addr(op, index=_index(ipr, link), address=str(address.ip),
                                    prefixlen=address.network.prefixlen)
    return Step(f"add address {address} to {link}", call("add"), call("del"))


def _plan_route(state: NetState, route: RouteSpec) -> list[Step]:
    metric = route.metric if route.metric is not None else (0 if route.family == 4 else 1024)
    dev_index = state.links[route.dev].index if route.dev in state.links else None
    same_key = [r for r in state.routes if r.dst == route.dst and r.metric == metric]
    for r in same_key:
        if r.via == route.via and (route.dev is None or r.oif == dev_index):
            return []
    text = f"route {route.dst}" + (f" via {route.via}" if route.via else "") + (f" dev {route.dev}" if route.dev else "")
    if not same_key:
        return [Step(f"add {text}", _route_call("add", route.dst, route.via, route.dev, metric),
                     _route_call("del", route.dst, route.via, route.dev, metric))]
    old = same_key[0]
    old_dev = state.link_name(old.oif) if old.oif is not None else None
    return [Step(f"replace {text} (was via {old.via or '-'} dev {old_dev or '-'})",
                 _route_call("replace", route.dst, route.via, route.dev, metric),
                 _route_call("replace", old.dst, old.via, old_dev, metric))]


def _route_call(op: str, dst, via, dev: str | None, metric: int):
    def call(ipr):
        kw = {"family": socket.AF_INET if dst.version == 4 else socket.AF_INET6, "dst": str(dst),
              "table": MAIN_TABLE, "priority": metric}
        if via is not None:
            kw["gateway"] = str(via)
        if dev is not None:
            kw["oif"] = _index(ipr, dev)
        ipr.route(op, **kw)
    return call


def _in(profile: Profile) -> str:
    return f" in netns {profile.netns}" if profile.netns else ""


# ---------------------------------------------------------------- applying
def apply(profile: Profile, dry_run: bool = False) -> list[str]:
    """Apply the profile (or only plan it); returns what changed (or would). Raises ApplyError/ProfileError."""
    create = profile.netns is not None and not netns_exists(profile.netns)
    if create and not profile.create_netns:
        raise ProfileError(f"netns: no network namespace named {profile.netns!r} (set create_netns: true)")
    if create and dry_run:
        return [f"create netns {profile.netns}"] + [s.text for s in plan(profile, NetState())]
    if create:
        from pyroute2 import netns

        netns.create(profile.netns)
    try:
        with open_netns(profile.netns) as ipr:
            steps = plan(profile, read_state(ipr))
            if not dry_run:
                _run(ipr, steps)
    except BaseException:
        if create:
            _remove_netns(profile.netns)
        raise
    return ([f"create netns {profile.netns}"] if create else []) + [s.text for s in steps]


def _run(ipr, steps: list[Step]) -> None:
    for k, step in enumerate(steps):
        log.info("net: %s", step.text)
        try:
            step.do(ipr)
        except Exception as exc:
            undone = _rollback(ipr, steps[:k])
            raise ApplyError(f"step {k + 1}/{len(steps)} '{step.text}' failed: {_reason(exc)}; "
                             f"rolled back {undone} earlier change(s)") from exc


def _rollback(ipr, done: list[Step]) -> int:
    undone = 0
    for step in reversed(done):
        if step.undo is None:
            continue
        try:
            step.undo(ipr)
            undone += 1
        except Exception as exc:  # keep undoing the rest; say what could not be undone
            log.error("net: could not undo '%s': %s", step.text, _reason(exc))
    return undone


def _remove_netns(name: str) -> None:
    from pyroute2 import netns

    try:
        netns.remove(name)
    except OSError as exc:
        log.error("net: could not remove netns %s: %s", name, exc)


def _reason(exc: Exception) -> str:
    args = getattr(exc, "args", ())
    if len(args) == 2 and isinstance(args[0], int):  # NetlinkError(code, message)
        return f"{args[1]} (errno {args[0]})"
    return str(exc) or type(exc).__name__


# ---------------------------------------------------------------- showing
def show(netns: str | None = None) -> str:
    """Links, addresses and main-table routes, as a short text report."""
    with open_netns(netns) as ipr:
        state = read_state(ipr)
    lines = [f"netns {netns or '(default)'}", "links:"]
    for link in sorted(state.links.values(), key=lambda l: l.index):
        addrs = " ".join(str(a) for a in sorted(state.addresses.get(link.index, ()), key=str))
        lines.append(f"  {link.index:>3} {link.name:<15} {link.kind or 'physical':<8} "
                     f"{'up' if link.up else 'down':<4} mtu {link.mtu:<6} {addrs}")
    lines.append("routes (main table):")
    for r in state.routes:
        lines.append(f"  {r.dst} via {r.via or '-'} dev {state.link_name(r.oif)} metric {r.metric}")
    return "\n".join(lines)
