"""Network profiles for the gateway appliance: links, MTU, addresses, routes, VLANs, per namespace.

A profile is a YAML file validated into frozen dataclasses; every error names the field
(`links[1].mtu: 70000 is outside 68..65535`). `blink/net/apply.py` turns a profile into a plan of
steps against the live kernel state (pyroute2) and applies it. Example (`deploy/net/*.yaml` has more):

    netns: blink-gw        # optional: apply inside this network namespace
    create_netns: false    # create it when missing
    links:
      - {name: eth1, state: up, mtu: 9000}                          # kind: existing (the default)
      - {name: veth0, kind: veth, peer: veth1, peer_netns: blink-be, state: up}
      - {name: eth1.100, kind: vlan, parent: eth1, vlan_id: 100, state: up}
    addresses:
      - {link: eth1, address: 10.0.0.1/24}
    routes:
      - {dst: 10.1.0.0/16, via: 10.0.0.254}
      - {dst: default, via: 10.0.0.254, metric: 100}

A profile only adds and sets: addresses and routes it does not list are left alone.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LINK_KINDS = ("existing", "veth", "vlan")
_IFNAME = re.compile(r"^[^/\s:]{1,15}$")  # the kernel's IFNAMSIZ - 1, no '/', ':' or spaces
_NETNS = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ProfileError(ValueError):
    """A profile that cannot be applied as written; the message names the field."""


@dataclass(frozen=True)
class LinkSpec:
    name: str
    kind: str = "existing"
    state: str | None = None  # up | down | None (leave as is)
    mtu: int | None = None
    peer: str | None = None  # veth: the other end's name
    peer_netns: str | None = None  # veth: move the other end into this namespace
    parent: str | None = None  # vlan: the link it rides on
    vlan_id: int | None = None


@dataclass(frozen=True)
class AddressSpec:
    link: str
    address: ipaddress.IPv4Interface | ipaddress.IPv6Interface


@dataclass(frozen=True)
class RouteSpec:
    dst: ipaddress.IPv4Network | ipaddress.IPv6Network
    via: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
    dev: str | None = None
    metric: int | None = None

    @property
    def family(self) -> int:
        return self.dst.version


@dataclass(frozen=True)
class Profile:
    netns: str | None = None
    create_netns: bool = False
    links: tuple[LinkSpec, ...] = ()
    addresses: tuple[AddressSpec, ...] = ()
    routes: tuple[RouteSpec, ...] = ()
    source: str = "<profile>"

    def link(self, name: str) -> LinkSpec | None:
        return next((link for link in self.links if link.name == name), None)


# ---------------------------------------------------------------- parsing
def load_profile(path: str | Path) -> Profile:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ProfileError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None
    try:
        return parse_profile(data, source=str(path))
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None


def parse_profile(data: Any, source: str = "<profile>") -> Profile:
    """Validate a profile's parsed YAML; raises ProfileError naming the first bad field."""
    top = _mapping(data, "profile", {"netns", "create_netns", "links", "addresses", "routes"})
    netns = _opt(top, "netns", str, "")
    if netns is not None and not _NETNS.match(netns):
        raise ProfileError(f"netns: {netns!r} is not a valid namespace name")
    links = tuple(_link(item, f"links[{i}]") for i, item in enumerate(_list(top, "links")))
    addresses = tuple(_address(item, f"addresses[{i}]") for i, item in enumerate(_list(top, "addresses")))
    routes = tuple(_route(item, f"routes[{i}]") for i, item in enumerate(_list(top, "routes")))
    profile = Profile(netns, bool(_opt(top, "create_netns", bool, "")), links, addresses, routes, source)
    _check_references(profile)
    return profile


def _link(item: Any, where: str) -> LinkSpec:
    m = _mapping(item, where, {"name", "kind", "state", "mtu", "peer", "peer_netns", "parent", "vlan_id"})
    name = _ifname(_req(m, "name", str, where), f"{where}.name")
    kind = _opt(m, "kind", str, where) or "existing"
    if kind not in LINK_KINDS:
        raise ProfileError(f"{where}.kind: {kind!r} is not one of {', '.join(LINK_KINDS)}")
    state = _opt(m, "state", str, where)
    if state not in (None, "up", "down"):
        raise ProfileError(f"{where}.state: {state!r} must be up or down")
    mtu = _opt(m, "mtu", int, where)
    if mtu is not None and not 68 <= mtu <= 65535:
        raise ProfileError(f"{where}.mtu: {mtu} is outside 68..65535")
    link = LinkSpec(name, kind, state, mtu, _opt(m, "peer", str, where), _opt(m, "peer_netns", str, where),
                    _opt(m, "parent", str, where), _opt(m, "vlan_id", int, where))
    _check_kind_fields(link, where)
    return link


def _check_kind_fields(link: LinkSpec, where: str) -> None:
    needs = {"veth": ("peer",), "vlan": ("parent", "vlan_id"), "existing": ()}[link.kind]
    for name in needs:
        if getattr(link, name) is None:
            raise ProfileError(f"{where}.{name}: required for kind {link.kind}")
    for name in ("peer", "peer_netns", "parent", "vlan_id"):
        if name not in needs and name != "peer_netns" and getattr(link, name) is not None:
            raise ProfileError(f"{where}.{name}: only for kind {'veth' if name == 'peer' else 'vlan'}")
    if link.peer_netns is not None and link.kind != "veth":
        raise ProfileError(f"{where}.peer_netns: only for kind veth")
    if link.peer is not None:
        _ifname(link.peer, f"{where}.peer")
    if link.vlan_id is not None and not 1 <= link.vlan_id <= 4094:
        raise ProfileError(f"{where}.vlan_id: {link.vlan_id} is outside 1..4094")


def _address(item: Any, where: str) -> AddressSpec:
    m = _mapping(item, where, {"link", "address"})
    text = _req(m, "address", str, where)
    if "/" not in text:
        raise ProfileError(f"{where}.address: {text!r} needs a prefix length (like 10.0.0.1/24)")
    try:
        address = ipaddress.ip_interface(text)
    except ValueError as exc:
        raise ProfileError(f"{where}.address: {exc}") from None
    return AddressSpec(_ifname(_req(m, "link", str, where), f"{where}.link"), address)


def _route(item: Any, where: str) -> RouteSpec:
    m = _mapping(item, where, {"dst", "via", "dev", "metric"})
    text = _req(m, "dst", str, where)
    try:
        dst = ipaddress.ip_network("0.0.0.0/0" if text == "default" else text)
        via = ipaddress.ip_address(m["via"]) if m.get("via") is not None else None
    except ValueError as exc:
        raise ProfileError(f"{where}: {exc}") from None
    if via is not None and via.version != dst.version:
        raise ProfileError(f"{where}.via: {via} is not the same address family as dst {dst}")
    dev = _opt(m, "dev", str, where)
    if via is None and dev is None:
        raise ProfileError(f"{where}: needs via, dev, or both")
    metric = _opt(m, "metric", int, where)
    if metric is not None and not 0 <= metric < 1 << 32:
        raise ProfileError(f"{where}.metric: {metric} is outside 0..2^32-1")
    return RouteSpec(dst, via, dev, metric)


def _check_references(p: Profile) -> None:
    names = [link.name for link in p.links]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ProfileError(f"links[{i}].name: {name!r} is listed twice")
    for i, link in enumerate(p.links):
        if link.kind == "vlan" and link.parent == link.name:
            raise ProfileError(f"links[{i}].parent: a VLAN cannot ride on itself")
    seen = set()
    for i, addr in enumerate(p.addresses):
        if (addr.link, addr.address) in seen:
            raise ProfileError(f"addresses[{i}]: {addr.address} on {addr.link} is listed twice")
        seen.add((addr.link, addr.address))


# ---------------------------------------------------------------- small validators
def _mapping(item: Any, where: str, allowed: set[str]) -> dict:
    if item is None and where == "profile":
        return {}
    if not isinstance(item, dict):
        raise ProfileError(f"{where}: expected a mapping, got {type(item).__name__}")
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise ProfileError(f"{where}.{unknown[0]}: unknown field (known: {', '.join(sorted(allowed))})")
    return item


def _list(m: dict, key: str) -> list:
    value = m.get(key) or []
    if not isinstance(value, list):
        raise ProfileError(f"{key}: expected a list, got {type(value).__name__}")
    return value


def _req(m: dict, key: str, kind: type, where: str):
    if m.get(key) is None:
        raise ProfileError(f"{where}.{key}: required")
    return _opt(m, key, kind, where)


def _opt(m: dict, key: str, kind: type, where: str):
    value = m.get(key)
    path = f"{where}.{key}" if where else key
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise ProfileError(f"{path}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _ifname(name: str, where: str) -> str:
    if not _IFNAME.match(name):
        raise ProfileError(f"{where}: {name!r} is not a valid interface name (1-15 chars, no '/', ':' or spaces)")
    return name
