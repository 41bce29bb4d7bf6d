from __future__ import annotations

from dataclasses import replace

import pytest

from hetrain.cluster import PRESETS, Cluster, Link, homogeneous, load_cluster, preset
from hetrain.errors import ConfigError


def test_presets_shapes_and_speeds() -> None:
    assert [d.flops for d in preset("hetero-4").devices] == [
        preset("hetero-4").devices[0].flops * s for s in (1, 1, 2, 4)]
    h8 = preset("hetero-8")
    base = h8.devices[0].flops
    assert [d.flops / base for d in h8.devices] == [1, 1, 2, 2, 4, 4, 8, 8]
    assert len({d.site for d in h8.devices}) == 2
    a, b = h8.sites
    assert b.wan == a.wan
    assert a.lan.bandwidth_Bps / a.wan.bandwidth_Bps == pytest.approx(100)
    assert preset("geo-16").n == 16 and preset("homo-4").ddp_efficiency_bound() == 1.0


def test_fastest_alone_is_the_fastest_device_next_to_the_ps() -> None:
    geo = preset("geo-16")
    alone = geo.fastest_alone()
    assert alone.n == 1 and alone.devices[0].flops == max(d.flops for d in geo.devices)
    assert alone.ps_site == alone.devices[0].site != geo.ps_site  # geo-16's fastest is remote
    assert load_cluster(alone.to_dict()) == alone


def test_links_in_series_and_paths() -> None:
    h8 = preset("hetero-8")
    same = h8.link_between(0, 2)
    cross = h8.link_between(0, 1)
    assert same == h8.sites[0].lan
    assert cross.bandwidth_Bps == h8.sites[0].wan.bandwidth_Bps
    assert cross.latency_s == pytest.approx(2 * h8.sites[0].wan.latency_s)
    assert Link(10, 1).then(Link(5, 2)) == Link(5, 3)


def test_ring_allreduce_matches_formula() -> None:
    c = homogeneous(4)
    lan = c.sites[0].lan
    m = 1e6
    assert c.ring_allreduce_time_s(m) == pytest.approx(2 * 3 * (lan.latency_s + m / (4 * lan.bandwidth_Bps)))
    assert c.ring_allreduce_time_s(m, [1]) == 0.0


@pytest.mark.parametrize("name", list(PRESETS))
def test_toml_round_trip(tmp_path, name: str) -> None:
    c = preset(name)
    c.save(tmp_path / "c.toml")
    assert Cluster.load(tmp_path / "c.toml") == c
    assert load_cluster(str(tmp_path / "c.toml")) == c
    measured = replace(c, ps_message_s=0.0016)  # a calibrated cluster keeps its PS cost
    measured.save(tmp_path / "m.toml")
    assert Cluster.load(tmp_path / "m.toml") == measured


def test_count_expands_devices() -> None:
    c = load_cluster({"sites": [{"name": "s", "lan": {"bandwidth_Bps": 1e9}, "wan": {"bandwidth_Bps": 1e8}}],
                      "devices": [{"name": "gpu", "flops": 1e9, "count": 3}]})
    assert [d.name for d in c.devices] == ["gpu-0", "gpu-1", "gpu-2"]


@pytest.mark.parametrize("data, message", [
    ({"sites": [], "devices": [], "colour": 1}, "unknown key(s) ['colour']"),
    ({"sites": [{"name": "s", "lan": {"bandwidth_Bps": 1}, "wan": {"bandwidth_Bps": 1}}],
      "devices": [{"name": "d", "flops": -1}]}, "flops must be a positive number"),
    ({"sites": [{"name": "s", "lan": {"bandwidth_Bps": 1}, "wan": {"bandwidth_Bps": 1}}],
      "devices": [{"name": "d", "flops": 1, "site": "mars"}]}, "site 'mars', which is not defined"),
    ({"sites": [{"name": "s", "lan": {"bandwidth_Bps": "fast"}, "wan": {"bandwidth_Bps": 1}}],
      "devices": [{"name": "d", "flops": 1}]}, "'bandwidth_Bps' must be a number"),
    ({"sites": [{"name": "s", "lan": {"bandwidth_Bps": 1}, "wan": {"bandwidth_Bps": 1}}],
      "devices": [{"name": "d", "flops": 1}, {"name": "d", "flops": 2}]}, "duplicate device names"),
    ({"sites": [{"name": "s", "lan": {"bandwidth_Bps": 1}, "wan": {"bandwidth_Bps": 1}}],
      "devices": [{"name": "d", "flops": 1}], "ps_message_s": -1}, "ps_message_s must be >= 0"),
    ({"sites": [{"name": "s", "lan": {"bandwidth_Bps": 1}, "wan": {"bandwidth_Bps": 1}}]},
     "missing required key(s) ['devices']"),
])
def test_bad_cluster_tables_name_the_problem(data, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_cluster(data)
    assert message in str(e.value)


def test_missing_and_invalid_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        Cluster.load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("devices = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Cluster.load(bad)
    with pytest.raises(ConfigError, match="unknown cluster preset"):
        preset("hetero-9")
