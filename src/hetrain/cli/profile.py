"""`hetrain profile CONFIG.toml`: measure the devices and links on real processes.

Writes a Cluster file (device speeds and access links as measured, for the planners:
`cluster = "measured.toml"` in a run config) and the ASHL stage-0 Profile (JSON). An
implausible fit is refused (exit 2) unless --force, which writes it with a warning; the output
says whether the figures are this machine's or the emulated cluster's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from hetrain.cli.output import Output
from hetrain.cli.run import apply_overrides
from hetrain.config import load_config
from hetrain.validate import check_number, check_output_file, integer, preflight

MAX_STEPS = 10_000
"""Most timed steps per batch size (each worker times 3 x --steps steps)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure step times and links on real processes",
                       description="Spawn the config's processes (as `hetrain launch` would), "
                       "time each worker's steps at batch b/2, b and 2b and its link to rank 0, "
                       "and write a Cluster TOML and a Profile JSON. A timing that cannot be a "
                       "speed is refused unless --force.")
    p.add_argument("config", help="run config TOML (its cluster, workload and [dist] are used)")
    p.add_argument("--out", default="", help="cluster TOML to write (default: "
                   "<runs-dir>/<name>-cluster.toml)")
    p.add_argument("--profile-out", default="", help="profile JSON to write (default: "
                   "<runs-dir>/<name>-profile.json)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per batch size")
    p.add_argument("--force", action="store_true", help="write an implausible fit anyway "
                   "(per-sample cost not positive, above 10 PFLOP/s, or noisy), with a warning")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set dist.emulate=none")
    p.add_argument("--runs-dir", default="runs",
                   help="where the default --out and --profile-out files go (default: runs)")
    p.add_argument("--quiet", action="store_true",
                   help="no per-device lines (warnings and errors are still printed)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from hetrain.engine.measure import measure
    from hetrain.profile.fit import speed_source

    cfg = apply_overrides(load_config(args.config), args.set)
    cfg = dataclasses.replace(cfg, engine="dist")
    check_number("--steps", args.steps, integer(1, MAX_STEPS))
    preflight(cfg, args.runs_dir if not (args.out and args.profile_out) else None)
    for flag, path in (("--out", args.out), ("--profile-out", args.profile_out)):
        if path:  # before measuring, not when saving what was measured
            check_output_file(path, flag)
    out = Output(args.quiet, args.json)
    m = measure(cfg, steps=args.steps, force=args.force)
    profile, cluster = m.profile, m.cluster
    if m.warning:  # never silent, not even with --quiet
        print(f"hetrain: warning: {m.warning}", file=sys.stderr)
    root = Path(args.runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    cluster_path = Path(args.out) if args.out else root / f"{cfg.name}-cluster.toml"
    profile_path = Path(args.profile_out) if args.profile_out else \
        root / f"{cfg.name}-profile.json"
    cluster.save(cluster_path)
    profile.save(profile_path)
    out.print(m.sources)
    tag = "measured" if cfg.dist.emulate == "none" else "emulated"
    for w, d, over in zip(profile.workers, cluster.devices, m.overruns, strict=True):
        assert d.link is not None
        speed = speed_source(cfg.dist.emulate, over, m.timed_steps)
        out.print(f"{w.name}: step {w.step_time_s * 1e3:.2f} ms at batch {w.batch_size}, "
                  f"{d.flops:.3g} FLOP/s ({speed}), link {d.link.bandwidth_Bps / 1e6:.1f} MB/s "
                  f"{d.link.latency_s * 1e3:.2f} ms ({tag})")
    out.print(f"wrote {cluster_path} and {profile_path}")
    out.json(profile.to_dict())
    return 0
