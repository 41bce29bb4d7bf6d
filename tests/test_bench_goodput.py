"""The goodput benchmark's bookkeeping (benchmarks/goodput.py): how the lone grid widens and
what a widened results file says made it."""

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
