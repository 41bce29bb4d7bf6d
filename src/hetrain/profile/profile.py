"""The profile of a run: per worker, compute time per iteration at a batch size, push and pull time.

ASHL's stage 0. A `Profile` is plain frozen data (JSON/TOML round trip) so the same type comes
from two sources:

- `Profile.from_cluster(cluster, ctx)`: the simulator's view, priced from the Cluster model
  (step time = step_overhead_s + batch * FLOPs/sample / FLOP/s; a transfer = latency +
  bytes / bandwidth on the worker's path to the PS). The simulator charges exactly these
  times (minus queueing on the PS's NIC when several transfers overlap), so this profile is
  what a timer would measure on the virtual clock.
- the real engine's profiler (`hetrain.engine.measure`), which times steps and transfers,
  fits them (`hetrain.profile.fit`) and builds the same type with `source = "measured"`.

Strategies refine their own cost estimates online from `Push.compute_s`, never from clocks.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w

from hetrain.cluster import Cluster
from hetrain.context import RunContext
from hetrain.errors import ConfigError


@dataclass(frozen=True)
class WorkerProfile:
    """What one worker costs: one iteration at `batch_size`, one push, one pull."""

    name: str
    """Device name (as in the Cluster)."""
    batch_size: int
    """Batch size the step time was measured (or priced) at."""
    step_time_s: float
    """Compute time of one training iteration (forward + backward + step) at `batch_size`."""
    push_time_s: float
    """Time to send one update to the parameter server."""
    pull_time_s: float
    """Time to receive the model from the parameter server."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"profile worker '{self.name}': batch_size must be >= 1")
        for key in ("step_time_s", "push_time_s", "pull_time_s"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"profile worker '{self.name}': {key} must be a finite "
                                  f"number >= 0, got {v!r}")
        if self.step_time_s <= 0:
            raise ConfigError(f"profile worker '{self.name}': step_time_s must be > 0")

    @property
    def comm_time_s(self) -> float:
        """Pull + push: the fixed cost of one commit."""
        return self.pull_time_s + self.push_time_s

    def round_time_s(self, local_steps: int) -> float:
        """Pull + `local_steps` iterations + push."""
        return self.pull_time_s + local_steps * self.step_time_s + self.push_time_s


@dataclass(frozen=True)
class Profile:
    """Per-worker costs of a run (ASHL stage 0), in the Cluster's device order."""

    workers: tuple[WorkerProfile, ...]
    model_bytes: int = 0
    """Bytes of one full pull (the fp32 model)."""
    push_bytes: int = 0
    """Bytes of one push (the model, or less when the update is compressed)."""
    source: str = "sim"
    """"sim" (priced from the Cluster model) or "measured" (timed on real devices)."""

    def __post_init__(self) -> None:
        if not self.workers:
            raise ConfigError("a profile needs at least one worker")

    @property
    def n(self) -> int:
        return len(self.workers)

    # ---- construction -----------------------------------------------------------------------
    @staticmethod
    def from_cluster(cluster: Cluster, ctx: RunContext, batch_size: int | None = None,
                     push_ratio: float = 1.0) -> Profile:
        """Price every worker from the Cluster model (what the simulator will charge).

        `push_ratio` is the compressor's `estimate_ratio` (compressed / fp32 bytes of a push).
        """
        if not 0 < push_ratio <= 1.0 + 1e-9:
            raise ConfigError(f"profile: push_ratio must be in (0, 1], got {push_ratio}")
        b = batch_size or ctx.batch_size
        push_bytes = max(1, round(ctx.model_bytes * push_ratio))
        workers = []
        for i, d in enumerate(cluster.devices):
            link = cluster.ps_link(i)
            workers.append(WorkerProfile(
                name=d.name, batch_size=b,
                step_time_s=d.compute_time_s(b, ctx.flops_per_sample, 1),
                push_time_s=link.transfer_time_s(push_bytes),
                pull_time_s=link.transfer_time_s(ctx.model_bytes)))
        return Profile(tuple(workers), ctx.model_bytes, push_bytes, "sim")

    @staticmethod
    def from_context(ctx: RunContext, batch_size: int | None = None,
                     push_ratio: float = 1.0) -> Profile:
        return Profile.from_cluster(ctx.cluster, ctx, batch_size, push_ratio)

    # ---- summaries --------------------------------------------------------------------------
    def step_times_s(self) -> list[float]:
        return [w.step_time_s for w in self.workers]

    def speeds(self) -> list[float]:
        """Relative iteration rates (1 / step time), the slowest worker = 1."""
        slowest = max(self.step_times_s())
        return [slowest / t for t in self.step_times_s()]

    # ---- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "model_bytes": self.model_bytes,
                "push_bytes": self.push_bytes, "workers": [asdict(w) for w in self.workers]}

    @staticmethod
    def from_dict(data: Mapping[str, Any], where: str = "profile") -> Profile:
        if not isinstance(data, Mapping) or "workers" not in data:
            raise ConfigError(f"{where}: expected a table with a 'workers' list")
        keys = {"name", "batch_size", "step_time_s", "push_time_s", "pull_time_s"}
        workers = []
        for k, w in enumerate(data["workers"]):
            if not isinstance(w, Mapping) or set(w) != keys:
                raise ConfigError(f"{where}: workers[{k}] must have exactly the keys {sorted(keys)}")
            workers.append(WorkerProfile(str(w["name"]), int(w["batch_size"]),
                                         float(w["step_time_s"]), float(w["push_time_s"]),
                                         float(w["pull_time_s"])))
        return Profile(tuple(workers), int(data.get("model_bytes", 0)),
                       int(data.get("push_bytes", 0)), str(data.get("source", "sim")))

    def save(self, path: str | Path) -> None:
        """Write JSON (".json") or TOML (any other suffix)."""
        p = Path(path)
        text = json.dumps(self.to_dict(), indent=2) if p.suffix == ".json" \
            else tomli_w.dumps(self.to_dict())
        p.write_text(text)

    @staticmethod
    def load(path: str | Path) -> Profile:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"profile file '{p}' not found; write one with `hetrain profile`")
        try:
            data = json.loads(p.read_text()) if p.suffix == ".json" \
                else tomllib.loads(p.read_text())
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"profile file '{p}' is not valid: {e}") from None
        return Profile.from_dict(data, str(p))


def worker_profiles(names: Sequence[str], batch_size: int, step_times_s: Sequence[float],
                    push_times_s: Sequence[float], pull_times_s: Sequence[float]
                    ) -> tuple[WorkerProfile, ...]:
    """Zip measured per-worker series into WorkerProfiles (for the real-engine profiler)."""
    n = len(names)
    if not (len(step_times_s) == len(push_times_s) == len(pull_times_s) == n):
        raise ConfigError("profile: names, step, push and pull times must have the same length")
    return tuple(WorkerProfile(str(nm), batch_size, float(s), float(pu), float(pl))
                 for nm, s, pu, pl in zip(names, step_times_s, push_times_s, pull_times_s,
                                          strict=True))
