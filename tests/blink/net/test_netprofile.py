"""Network profiles: the schema (errors name the field) and applying them in throwaway namespaces
(veth across namespaces, MTU 9000, addresses, a route, a VLAN; idempotent; dry run; rollback)."""
from __future__ import annotations

import ipaddress
import subprocess

import pytest

from blink import ctl
from blink.net.profile import ProfileError, parse_profile
from netns_helpers import drop_netns, kernel_has_vlan, make_netns, netns_pair  # noqa: F401  (fixture)

pyroute2 = pytest.importorskip("pyroute2", reason="pyroute2 is needed to apply profiles")


@pytest.mark.parametrize("data, where", [
    ({"links": [{"name": "eth0", "mtu": 70000}]}, "links[0].mtu: 70000 is outside"),
    ({"links": [{"name": "eth0", "mtu": "9000"}]}, "links[0].mtu: expected int"),
    ({"links": [{"name": "eth0"}, {"name": "v0", "kind": "vlan", "parent": "eth0"}]}, "links[1].vlan_id: required"),
    ({"links": [{"name": "v0", "kind": "veth"}]}, "links[0].peer: required"),
    ({"links": [{"name": "v0", "kind": "bond"}]}, "links[0].kind: 'bond' is not one of"),
    ({"links": [{"name": "eth0", "state": "on"}]}, "links[0].state: 'on' must be up or down"),
    ({"links": [{"name": "a/b"}]}, "links[0].name: 'a/b' is not a valid interface name"),
    ({"links": [{"name": "eth0", "speed": 1}]}, "links[0].speed: unknown field"),
    ({"links": [{"name": "eth0"}, {"name": "eth0"}]}, "links[1].name: 'eth0' is listed twice"),
    ({"addresses": [{"link": "eth0", "address": "10.0.0.1"}]}, "addresses[0].address: '10.0.0.1' needs a prefix"),
    ({"addresses": [{"link": "eth0", "address": "10.0.0.300/24"}]}, "addresses[0].address:"),
    ({"routes": [{"dst": "10.0.0.0/8"}]}, "routes[0]: needs via, dev, or both"),
    ({"routes": [{"dst": "10.0.0.0/8", "via": "fe80::1"}]}, "routes[0].via: fe80::1 is not the same address family"),
    ({"netns": "bad name"}, "netns: 'bad name' is not a valid"),
    ({"vlans": []}, "profile.vlans: unknown field"),
    ([1, 2], "profile: expected a mapping"),
])
def test_schema_errors_name_the_field(data, where):
    with pytest.raises(ProfileError) as exc:
        parse_profile(data)
    assert str(exc.value).startswith(where), str(exc.value)


def test_a_full_profile_parses_into_frozen_dataclasses():
    p = parse_profile({"netns": "gw", "links": [{"name": "eth1", "state": "up", "mtu": 9000},
                                                {"name": "eth1.100", "kind": "vlan", "parent": "eth1", "vlan_id": 100}],
                       "addresses": [{"link": "eth1", "address": "10.0.0.1/24"}],
                       "routes": [{"dst": "default", "via": "10.0.0.254", "metric": 10}]})
    assert p.links[1].vlan_id == 100 and p.addresses[0].address == ipaddress.ip_interface("10.0.0.1/24")
    assert p.routes[0].dst == ipaddress.ip_network("0.0.0.0/0")
    with pytest.raises(AttributeError):
        p.links[0].mtu = 1500


def write(tmp_path, name, text) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def links(ns: str) -> str:
    return subprocess.run(["ip", "-n", ns, "-o", "addr"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "-n", ns, "-o", "link"], capture_output=True, text=True).stdout


def test_apply_across_two_namespaces_is_idempotent(netns_pair, tmp_path, capsys):
    a, b = netns_pair
    side_a = write(tmp_path, "a.yaml", f"""
netns: {a}
links:
  - {{name: lo, state: up}}
  - {{name: t0, kind: veth, peer: t1, peer_netns: {b}, mtu: 9000, state: up}}
addresses:
  - {{link: t0, address: 10.77.0.1/24}}
routes:
  - {{dst: 10.78.0.0/16, via: 10.77.0.2}}
""")
    side_b = write(tmp_path, "b.yaml", f"""
netns: {b}
links:
  - {{name: t1, mtu: 9000, state: up}}
addresses:
  - {{link: t1, address: 10.77.0.2/24}}
""")
    assert ctl.main(["net", "check", side_a]) == 1  # drift: nothing applied yet
    assert ctl.main(["net", "apply", "--dry-run", side_a]) == 0
    assert "t0" not in links(a)  # a dry run changes nothing
    capsys.readouterr()
    assert ctl.main(["net", "apply", side_a]) == 0 and ctl.main(["net", "apply", side_b]) == 0
    out = capsys.readouterr().out
    assert "create veth t0 <-> t1" in out and "set t0 mtu" in out and "add route 10.78.0.0/16 via 10.77.0.2" in out
    assert "mtu 9000" in links(a) and "10.77.0.1/24" in links(a) and "10.77.0.2/24" in links(b)
    assert ctl.main(["net", "apply", side_a]) == 0 and ctl.main(["net", "apply", side_b]) == 0
    assert capsys.readouterr().out.count("nothing to change") == 2
    assert ctl.main(["net", "check", side_a]) == 0
    assert ctl.main(["net", "show", "--netns", a]) == 0
    assert "10.78.0.0/16 via 10.77.0.2" in capsys.readouterr().out


def test_a_failing_step_rolls_back_the_earlier_ones(netns_pair, tmp_path, capsys):
    a, _ = netns_pair
    before = links(a)
    bad = write(tmp_path, "bad.yaml", f"""
netns: {a}
links:
  - {{name: r0, kind: veth, peer: r1, mtu: 9000, state: up}}
addresses:
  - {{link: r0, address: 10.79.0.1/24}}
routes:
  - {{dst: 10.80.0.0/16, via: 192.0.2.1}}   # not on any link: the kernel refuses it
""")
    assert ctl.main(["net", "apply", bad]) == 1
    err = capsys.readouterr().err
    assert "step 5/5 'add route 10.80.0.0/16 via 192.0.2.1' failed" in err and "rolled back 2 earlier" in err  # address, then the veth (its mtu and state go with it)
    assert links(a) == before  # no r0/r1, no address


def test_vlan_on_a_veth(tmp_path, capsys):
    ns = make_netns("blink-v")
    try:
        if not kernel_has_vlan(ns):
            pytest.skip("this kernel has no 802.1Q VLAN support (8021q); skipping the VLAN case")
        profile = write(tmp_path, "vlan.yaml", f"""
netns: {ns}
links:
  - {{name: p0, kind: veth, peer: p1, mtu: 9000, state: up}}
  - {{name: p0.42, kind: vlan, parent: p0, vlan_id: 42, mtu: 9000, state: up}}
addresses:
  - {{link: p0.42, address: 10.81.0.1/24}}
""")
        assert ctl.main(["net", "apply", profile]) == 0
        assert "p0.42@p0" in links(ns) and "10.81.0.1/24" in links(ns)
        assert ctl.main(["net", "apply", profile]) == 0 and "nothing to change" in capsys.readouterr().out
    finally:
        drop_netns(ns)


def test_missing_links_and_namespaces_are_profile_errors(netns_pair, tmp_path, capsys):
    a, _ = netns_pair
    assert ctl.main(["net", "apply", write(tmp_path, "x.yaml", f"netns: {a}\nlinks: [{{name: nope0, mtu: 1400}}]\n")]) == 2
    assert "links[0].name: no link named 'nope0'" in capsys.readouterr().err
    assert ctl.main(["net", "apply", write(tmp_path, "y.yaml", "netns: blink-no-such-ns\n")]) == 2
    assert "create_netns: true" in capsys.readouterr().err
