"""The goodput benchmark's bookkeeping (benchmarks/goodput.py): how the lone grid widens and
what a widened results file says made it."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

from goodput import beyond_edges, provenance


def test_the_grid_widens_past_each_edge_a_pick_sits_on() -> None:
    tried = {(b, lr) for b in (8, 16) for lr in (0.01, 0.02)}
    assert sorted(beyond_edges(tried, (8, 0.01))) == [(4, 0.01), (8, 0.005)]
    assert sorted(beyond_edges(tried, (16, 0.02))) == [(16, 0.04), (32, 0.02)]
    assert beyond_edges(tried | {(4, 0.01), (8, 0.005)}, (8, 0.01)) == []
    square = {(b, lr) for b in (2, 4) for lr in (0.01, 0.02)}
    assert beyond_edges(square, (2, 0.02)) == [(2, 0.04)]     # no batch below 2


def test_widening_keeps_the_files_provenance() -> None:
    fresh = provenance(None, "goodput.py --jobs 2")
    assert fresh == {"command": "goodput.py --jobs 2"}
    rerun = fresh | {"auto_rerun": "goodput.py --rerun-auto f.json"}
    once = provenance(rerun, "goodput.py --widen-json f.json")
    assert once == rerun | {"widened": "goodput.py --widen-json f.json"}
    twice = provenance(once | {"runs": []}, "goodput.py --widen-json g.json")
    assert twice["widened"] == "goodput.py --widen-json f.json, then goodput.py --widen-json g.json"
    assert twice["auto_rerun"] == rerun["auto_rerun"] and "runs" not in twice


def test_the_ceiling_takes_the_batch_whose_rounds_cost_least() -> None:
    from goodput_ceiling import ceiling

    lone = {4: 10.0, 8: 12.0}                 # the lone device's TTA at each batch
    step = {4: 1.0, 8: 1.5}                   # its step time there
    rounds = {4: 0.6, 8: 0.8}                 # the cluster's round at the same batch
    speedup, batch = ceiling(lone, step, rounds, tuned_tta=9.0)
    assert batch == 4 and speedup == 9.0 / 6.0   # 10 x 0.6 / 1.0 = 6 < 12 x 0.8 / 1.5 = 6.4


def test_two_equal_devices_halve_the_compute_of_a_round() -> None:
    from goodput_ceiling import shortest_round_s, site_costs

    from hetrain.cluster import homogeneous
    from hetrain.plan.goodput import cluster_costs

    pair, fps, model_bytes = homogeneous(2), 1e6, 4_000_000
    dev = pair.devices[0]
    free = shortest_round_s(site_costs(pair, fps, model_bytes, free_links=True), 16)
    assert free == dev.compute_time_s(8, fps)         # 8 samples each, no link cost
    linked = shortest_round_s(site_costs(pair, fps, model_bytes, free_links=False), 16)
    c = cluster_costs(pair, pair.ps_site, fps, model_bytes)
    both = c.comm_s[0] + dev.compute_time_s(8, fps) + 2 * c.member_s
    alone = c.comm_s[0] + dev.compute_time_s(16, fps) + c.member_s
    assert free < linked and math.isclose(linked, min(both, alone))


def test_fixed_options_are_typed_like_the_option() -> None:
    from goodput_factor import fixed_option

    assert fixed_option("noise_scale=8") == ("noise_scale", 8.0)
    assert fixed_option("min_batch=4") == ("min_batch", 4)
    assert fixed_option("lr_follows_noise=1") == ("lr_follows_noise", True)


def test_final_noise_pools_auto_against_the_picked_lone_runs() -> None:
    from goodput import final_noise

    def run(system: str, seed: int, accuracy: float, batch: int = 32) -> dict:
        rows = [{"test_accuracy": accuracy, "time_s": float(t)} for t in range(8)]
        return {"system": system, "cluster": "hetero-4", "seed": seed, "batch": batch,
                "lr": 0.05, "rows": rows}

    lone = {3: 0.95, 4: 0.96, 5: 0.94}
    cells = [{"cluster": "hetero-4", "lone_setting": {"batch": 32, "lr": 0.05}}]
    data = {"workload": "mnist1d-cnn", "report_seeds": [3, 4, 5], "cells": cells,
            "runs": [run("lone", s, a) for s, a in lone.items()]
            + [run("lone", s, 0.5, batch=8) for s in lone]          # a setting not picked
            + [run("auto", s, a - 0.01) for s, a in lone.items()]}
    noise = final_noise(data, resamples=2000)
    assert math.isclose(noise["pooled_gap"]["mean"], -1.0)          # points, every run
    assert all(math.isclose(x, -1.0) for x in noise["pooled_gap"]["ci90"])
    assert math.isclose(noise["run_sd"], 1.0)                       # both groups: sd 1 point
    # the median of 3 differences of sd sqrt(2): about 0.67 x sqrt(2) = 0.95
    assert 0.85 < noise["same_system_cell_sd"] < 1.05
    assert 0.25 < noise["same_system_below_half"] < 0.38            # P(N(0, 0.95) < -0.5)


def test_extending_takes_only_new_held_out_seeds() -> None:
    import argparse

    import pytest
    from goodput import extend

    saved = {"report_seeds": [3, 4, 5], "select_seeds": [0, 1, 2]}
    for seeds in ([3, 4], [1, 6], []):
        args = argparse.Namespace(workload="mnist1d-cnn", report_seeds=seeds)
        with pytest.raises(SystemExit, match="neither"):
            extend(args, saved)


def test_an_extended_file_reads_its_base_runs_only_while_they_are_unchanged(tmp_path) -> None:
    import json

    import pytest
    from goodput import repoint_base, runs_digest, with_base_runs

    base = [{"system": "auto", "seed": 3}]
    (tmp_path / "base.json").write_text(json.dumps({"runs": base}))
    ext = {"runs": [{"system": "auto", "seed": 6}], "extended": "goodput.py --extend-json",
           "extends": {"file": "base.json", "runs_sha256": runs_digest(base)}}
    assert [r["seed"] for r in with_base_runs(ext, tmp_path)["runs"]] == [3, 6]
    assert with_base_runs({"runs": []}, tmp_path) == {"runs": []}   # not an extension
    (tmp_path / "base.json").write_text(json.dumps({"runs": base + base}))
    with pytest.raises(SystemExit, match="not the file this one extended"):
        with_base_runs(ext, tmp_path)
    # after --rerun-auto of both files the pair is re-made together
    assert len(with_base_runs(repoint_base(ext, tmp_path), tmp_path)["runs"]) == 3
