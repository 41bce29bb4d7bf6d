"""The cluster model every planner and engine shares: devices, links, sites, the PS placement.

A Cluster is plain frozen data (saved and replayed as TOML). Units are in the names:
compute speed in FLOP/s (a workload's FLOPs per sample turn it into samples/s), bandwidth in
bytes/s, latency in seconds. Devices live in sites; a site has a LAN (device<->device inside
it) and a WAN uplink; traffic between two sites crosses both sites' uplinks, so it runs at the
smaller bandwidth and pays both latencies. A device may also have its own access link (a slow
NIC) which is in series with every path it takes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w

from hetrain.errors import ConfigError
from hetrain.validate import (
    MAX_DEVICES,
    check_device_kind,
    check_number,
    integer,
    non_negative,
    positive,
    read_text_file,
)


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: moving n bytes takes latency_s + n / bandwidth_Bps."""

    bandwidth_Bps: float
    """Sustained bandwidth in bytes per second."""
    latency_s: float = 0.0
    """One-way latency in seconds."""

    def __post_init__(self) -> None:
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ConfigError(f"link bandwidth_Bps must be a positive number, got {self.bandwidth_Bps}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ConfigError(f"link latency_s must be >= 0, got {self.latency_s}")

    def transfer_time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps

    def then(self, other: Link) -> Link:
        """Two links in series: the narrower bandwidth, the sum of latencies."""
        return Link(min(self.bandwidth_Bps, other.bandwidth_Bps), self.latency_s + other.latency_s)


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU worker) as the planners see it."""

    name: str
    """Unique name, e.g. "a100-0"."""
    flops: float
    """Effective training FLOP/s on the workload (measured by `hetrain profile` or estimated)."""
    memory_bytes: float = 16e9
    """Memory available for parameters, gradients, optimizer state and activations."""
    site: str = "site0"
    """Name of the site (data centre / node) the device sits in."""
    step_overhead_s: float = 0.0
    """Fixed cost of one optimizer step (kernel launches, Python): makes tiny batches inefficient."""
    link: Link | None = None
    """The device's own access link, in series with every path it takes (None: not a bottleneck)."""
    torch_device: str | None = None
    """The real engine: where this device's worker computes, cpu | cuda | cuda:N | auto
    (None: the run's dist.device; see hetrain.engine.devices)."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError("device name must be a non-empty string")
        if self.torch_device is not None:
            check_device_kind(f"device '{self.name}': torch_device", self.torch_device)
        check_number(f"device '{self.name}': flops", self.flops, positive())
        check_number(f"device '{self.name}': memory_bytes", self.memory_bytes, positive())
        check_number(f"device '{self.name}': step_overhead_s", self.step_overhead_s,
                     non_negative())

    def compute_time_s(self, samples: float, flops_per_sample: float, steps: int = 1) -> float:
        """Time to run `steps` optimizer steps over `samples` samples in total."""
        return steps * self.step_overhead_s + samples * flops_per_sample / self.flops

    def samples_per_s(self, flops_per_sample: float) -> float:
        return self.flops / flops_per_sample


@dataclass(frozen=True)
class Site:
    """A group of devices on a fast local network, joined to other sites by its WAN uplink."""

    name: str
    lan: Link
    """Device<->device (and device<->PS) link inside the site."""
    wan: Link
    """The site's uplink to other sites."""


@dataclass(frozen=True)
class Cluster:
    """Devices + sites + where the parameter server / data owner lives."""

    name: str
    devices: tuple[Device, ...]
    sites: tuple[Site, ...]
    ps_site: str = ""
    """Site of the parameter server (the data owner in C-ADP); default: the first site."""
    ps_nic: Link | None = None
    """The PS's own network card; concurrent transfers to/from the PS queue on it (None: no cap)."""
    ps_message_s: float = 0.0
    """Time the PS process is busy per message it sends or receives (framing, (de)serialising,
    copying), one message at a time, in series with the link: what a synchronous round of n
    workers pays n times over. 0 for the presets; `hetrain.engine.measure.measure_overheads`
    measures it on a real machine."""

    def __post_init__(self) -> None:
        if not self.devices:
            raise ConfigError(f"cluster '{self.name}': needs at least one device")
        if not self.sites:
            raise ConfigError(f"cluster '{self.name}': needs at least one [[sites]] entry")
        names = [d.name for d in self.devices]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"cluster '{self.name}': duplicate device names {dup}")
        site_names = [s.name for s in self.sites]
        if len(set(site_names)) != len(site_names):
            raise ConfigError(f"cluster '{self.name}': duplicate site names in {site_names}")
        for d in self.devices:
            if d.site not in site_names:
                raise ConfigError(
                    f"cluster '{self.name}': device '{d.name}' is in site '{d.site}', "
                    f"which is not defined; defined sites: {site_names}"
                )
        if not self.ps_site:
            object.__setattr__(self, "ps_site", self.sites[0].name)
        if not (self.ps_message_s >= 0 and math.isfinite(self.ps_message_s)):
            raise ConfigError(f"cluster '{self.name}': ps_message_s must be >= 0, "
                              f"got {self.ps_message_s}")
        elif self.ps_site not in site_names:
            raise ConfigError(
                f"cluster '{self.name}': ps_site '{self.ps_site}' is not one of {site_names}"
            )

    # ---- topology -------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.devices)

    def site(self, name: str) -> Site:
        return next(s for s in self.sites if s.name == name)

    def _path(self, site_a: str, site_b: str) -> Link:
        if site_a == site_b:
            return self.site(site_a).lan
        return self.site(site_a).wan.then(self.site(site_b).wan)

    def link_between(self, i: int, j: int) -> Link:
        """Effective link between devices i and j (access links, LAN or both WAN uplinks)."""
        a, b = self.devices[i], self.devices[j]
        path = self._path(a.site, b.site)
        for own in (a.link, b.link):
            if own is not None:
                path = own.then(path)
        return path

    def ps_link(self, i: int) -> Link:
        """Effective link between device i and the parameter server."""
        d = self.devices[i]
        path = self._path(d.site, self.ps_site)
        return d.link.then(path) if d.link is not None else path

    def ring_allreduce_time_s(self, nbytes: float, members: list[int] | None = None) -> float:
        """Ring all-reduce of `nbytes` over `members` (default all devices).

        2(n-1) synchronous steps each moving nbytes/n over every ring hop; a step lasts as long
        as the slowest hop: 2(n-1) * (latency_max + nbytes / (n * bandwidth_min)). The ring
        visits devices site by site so only one hop per site boundary crosses a WAN.
        """
        idx = sorted(members if members is not None else range(self.n),
                     key=lambda k: (self.devices[k].site, k))
        n = len(idx)
        if n <= 1:
            return 0.0
        hops = [self.link_between(idx[k], idx[(k + 1) % n]) for k in range(n)]
        bw = min(h.bandwidth_Bps for h in hops)
        lat = max(h.latency_s for h in hops)
        return 2 * (n - 1) * (lat + nbytes / (n * bw))

    # ---- summaries ------------------------------------------------------------------------
    def total_flops(self) -> float:
        return sum(d.flops for d in self.devices)

    def ddp_efficiency_bound(self) -> float:
        """Hardware efficiency of equal-batch synchronous training: n * min / sum."""
        return self.n * min(d.flops for d in self.devices) / self.total_flops()

    def with_device(self, i: int, **changes: Any) -> Cluster:
        """A copy with device i changed (e.g. slowed down mid-run)."""
        devices = list(self.devices)
        devices[i] = replace(devices[i], **changes)
        return replace(self, devices=tuple(devices))

    def fastest_alone(self) -> Cluster:
        """The fastest device (most FLOP/s) on its own, next to the PS: the single-device
        baseline a distributed run on this cluster has to beat to be worth its devices."""
        fastest = max(self.devices, key=lambda d: d.flops)
        return Cluster(f"{self.name}-fastest", (fastest,), self.sites, ps_site=fastest.site,
                       ps_nic=self.ps_nic, ps_message_s=self.ps_message_s)

    # ---- TOML -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def clean(d: dict[str, Any]) -> dict[str, Any]:
            return {k: (clean(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}

        out: dict[str, Any] = {"name": self.name, "ps_site": self.ps_site}
        if self.ps_nic is not None:
            out["ps_nic"] = asdict(self.ps_nic)
        if self.ps_message_s:
            out["ps_message_s"] = self.ps_message_s
        out["sites"] = [clean(asdict(s)) for s in self.sites]
        out["devices"] = [clean(asdict(d)) for d in self.devices]
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(tomli_w.dumps(self.to_dict()))

    @staticmethod
    def from_dict(data: Mapping[str, Any], source: str = "cluster") -> Cluster:
        return _cluster_from_dict(data, source)

    @staticmethod
    def load(path: str | Path) -> Cluster:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"cluster file '{p}' not found; give a TOML file or a preset name "
                              f"({', '.join(sorted(PRESETS))})")
        try:
            data = tomllib.loads(read_text_file(p, "cluster file"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"cluster file '{p}' is not valid TOML: {e}") from None
        return _cluster_from_dict(data, str(p))


# ---- parsing with messages that name the key --------------------------------------------------
_LINK_KEYS = {"bandwidth_Bps", "latency_s"}
_DEVICE_KEYS = {"name", "flops", "memory_bytes", "site", "step_overhead_s", "link", "count",
                "torch_device"}
_SITE_KEYS = {"name", "lan", "wan"}
_CLUSTER_KEYS = {"name", "devices", "sites", "ps_site", "ps_nic", "ps_message_s"}


def check_keys(where: str, data: Mapping[str, Any], allowed: set[str], required: set[str]) -> None:
    """Raise a ConfigError naming unknown or missing keys and the allowed ones."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a table, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed keys: {sorted(allowed)}")
    missing = sorted(required - set(data))
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {missing}")


def _number(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: '{key}' must be a number, got {value!r}")
    return float(value)


def _device_kind(where: str, d: dict[str, Any]) -> str | None:
    if "torch_device" not in d:
        return None
    return check_device_kind(f"{where}: 'torch_device'", d["torch_device"])


def _name(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    return value


def _tables(where: str, key: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: '{key}' must be an array of tables ([[{key}]] entries), "
                          f"got {value!r}")
    return value


def _link(where: str, data: Any) -> Link:
    check_keys(where, data, _LINK_KEYS, {"bandwidth_Bps"})
    return Link(_number(where, "bandwidth_Bps", data["bandwidth_Bps"]),
                _number(where, "latency_s", data.get("latency_s", 0.0)))


def _cluster_from_dict(data: Mapping[str, Any], source: str) -> Cluster:
    check_keys(source, data, _CLUSTER_KEYS, {"devices", "sites"})
    sites = []
    for k, s in enumerate(_tables(source, "sites", data["sites"])):
        where = f"{source}: sites[{k}]"
        check_keys(where, s, _SITE_KEYS, {"name", "lan", "wan"})
        sites.append(Site(_name(where, "name", s["name"]), _link(f"{where}.lan", s["lan"]),
                          _link(f"{where}.wan", s["wan"])))
    entries = _tables(source, "devices", data["devices"])
    counts = []
    for k, d in enumerate(entries):
        where = f"{source}: devices[{k}]"
        check_keys(where, d, _DEVICE_KEYS, {"name", "flops"})
        _name(where, "name", d["name"])
        if "site" in d:
            _name(where, "site", d["site"])
        counts.append(int(check_number(f"{where}: 'count'", d.get("count", 1),
                                       integer(1, MAX_DEVICES))))
        if sum(counts) > MAX_DEVICES:
            raise ConfigError(f"{where}: the cluster would have {sum(counts):,} devices; a "
                              f"cluster has at most {MAX_DEVICES:,} (lower 'count')")
    devices = []
    for k, (d, count) in enumerate(zip(entries, counts, strict=True)):
        where = f"{source}: devices[{k}]"
        for c in range(count):
            devices.append(Device(
                name=d["name"] if count == 1 else f"{d['name']}-{c}",
                flops=_number(where, "flops", d["flops"]),
                memory_bytes=_number(where, "memory_bytes", d.get("memory_bytes", 16e9)),
                site=d.get("site", sites[0].name if sites else "site0"),
                step_overhead_s=_number(where, "step_overhead_s", d.get("step_overhead_s", 0.0)),
                link=_link(f"{where}.link", d["link"]) if "link" in d else None,
                torch_device=_device_kind(where, d),
            ))
    ps_nic = _link(f"{source}: ps_nic", data["ps_nic"]) if "ps_nic" in data else None
    name = _name(source, "name", data["name"]) if "name" in data else Path(source).stem
    ps_site = data.get("ps_site", "")  # "": the first site
    if not isinstance(ps_site, str):
        raise ConfigError(f"{source}: 'ps_site' must be a site's name, got {ps_site!r}")
    return Cluster(name=name, devices=tuple(devices),
                   sites=tuple(sites), ps_site=ps_site, ps_nic=ps_nic,
                   ps_message_s=_number(source, "ps_message_s", data.get("ps_message_s", 0.0)))


# ---- presets ----------------------------------------------------------------------------------
GBIT = 1e9 / 8
"""Bytes per second in one Gbit/s."""
BASE_FLOPS = 2e8
"""Effective FLOP/s of the slowest preset device. The presets are scaled for the small built-in
models: a step of the slowest device at batch 32 on the MNIST-1D CNN (~1 MFLOP/sample) takes
~0.16 s, so compute and communication stand in the proportion large models see on real
clusters (seconds of compute against hundreds of milliseconds of WAN all-reduce), rather than
a microsecond of compute against milliseconds of latency."""
LAN = Link(10 * GBIT, 50e-6)
STEP_OVERHEAD_S = 2e-3


@dataclass(frozen=True)
class _Preset:
    speeds: tuple[float, ...]
    sites: tuple[Site, ...]
    site_of: tuple[int, ...] = field(default=())

    def build(self, name: str) -> Cluster:
        site_of = self.site_of or (0,) * len(self.speeds)
        devices = tuple(
            Device(name=f"dev{i}", flops=BASE_FLOPS * s, memory_bytes=16e9,
                   site=self.sites[site_of[i]].name, step_overhead_s=STEP_OVERHEAD_S)
            for i, s in enumerate(self.speeds))
        return Cluster(name=name, devices=devices, sites=self.sites, ps_site=self.sites[0].name,
                       ps_nic=Link(25 * GBIT, 10e-6))


def _site(name: str, wan_gbit: float, wan_latency_s: float) -> Site:
    return Site(name, LAN, Link(wan_gbit * GBIT, wan_latency_s))


PRESETS: dict[str, _Preset] = {
    # 4 equal devices on one LAN: the case DDP is built for.
    "homo-4": _Preset((1, 1, 1, 1), (_site("dc", 10, 50e-6),)),
    # 4 devices of speeds 1:1:2:4 on one LAN.
    "hetero-4": _Preset((1, 1, 2, 4), (_site("dc", 10, 50e-6),)),
    # 8 devices 1:1:2:2:4:4:8:8 in two sites; the sites are joined by a 100x slower link
    # (10 Gbit/s LAN, 0.1 Gbit/s between sites, 5 ms each way per uplink).
    "hetero-8": _Preset((1, 1, 2, 2, 4, 4, 8, 8),
                        (_site("site-a", 0.1, 5e-3), _site("site-b", 0.1, 5e-3)),
                        (0, 1, 0, 1, 0, 1, 0, 1)),
    # 16 devices in four regions with uneven WAN uplinks and latencies (geo-distributed).
    "geo-16": _Preset((1, 1, 2, 4, 1, 2, 2, 8, 1, 1, 4, 4, 2, 2, 8, 8),
                      (_site("us-east", 1.0, 5e-3), _site("us-west", 0.5, 20e-3),
                       _site("europe", 0.2, 40e-3), _site("asia", 0.1, 60e-3)),
                      (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)),
}


def preset(name: str) -> Cluster:
    """A built-in cluster by name; a clear error lists the presets."""
    if name not in PRESETS:
        raise ConfigError(f"unknown cluster preset '{name}'; choose one of: {', '.join(PRESETS)}"
                          " or give a path to a cluster TOML file")
    return PRESETS[name].build(name)


def homogeneous(n: int, flops: float = BASE_FLOPS, name: str | None = None) -> Cluster:
    """n equal devices on one LAN (scaling studies)."""
    site = _site("dc", 10, 50e-6)
    devices = tuple(Device(f"dev{i}", flops, site="dc", step_overhead_s=STEP_OVERHEAD_S)
                    for i in range(n))
    return Cluster(name or f"homo-{n}", devices, (site,), ps_nic=Link(25 * GBIT, 10e-6))


def load_cluster(spec: str | Path | Mapping[str, Any]) -> Cluster:
    """A preset name, a TOML path, or an inline table (from a run config)."""
    if isinstance(spec, Mapping):
        return _cluster_from_dict(spec, "cluster")
    if str(spec) in PRESETS:
        return preset(str(spec))
    return Cluster.load(spec)
