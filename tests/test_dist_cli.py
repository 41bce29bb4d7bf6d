"""`hetrain launch` and `hetrain profile` on real processes (1 server + 2 workers)."""

from __future__ import annotations

import json

import pytest

from hetrain.cli import main
from hetrain.cluster import Cluster
from hetrain.profile import Profile

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

CONFIG = """
name = "pair"
engine = "sim"
[cluster]
name = "pair"
sites = [{ name = "s", lan = { bandwidth_Bps = 1e9 }, wan = { bandwidth_Bps = 1e9 } }]
devices = [{ name = "slow", flops = 2e8 }, { name = "fast", flops = 8e8 }]
[workload]
model = "cnn"
dataset = "mnist1d"
dataset_options = { num_samples = 4000 }
[strategy]
name = "local_sgd"
local_steps = 2
[stop]
max_epochs = 0.1
[dist]
time_scale = 0.1
"""


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "pair.toml"
    p.write_text(CONFIG)
    return p


def test_launch_runs_the_config_on_real_processes(config, tmp_path, capsys) -> None:
    rc = main(["launch", str(config), "--nproc", "3", "--runs-dir", str(tmp_path / "runs"),
               "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)[0]
    assert summary["engine"] == "dist" and summary["updates"] >= 1
    assert (tmp_path / "runs" / "pair" / "checkpoint.pt").is_file()


def test_launch_wrong_nproc_names_the_fix(config, capsys) -> None:
    assert main(["launch", str(config), "--nproc", "5"]) == 2
    assert "--nproc 3" in capsys.readouterr().err


def test_launch_multinode_prints_this_nodes_processes(config, capsys) -> None:
    rc = main(["launch", str(config), "--nnodes", "2", "--node-rank", "1",
               "--nproc-per-node", "2,1", "--rdzv-endpoint", "host0:29400", "--dry-run"])
    assert rc == 0
    (line,) = capsys.readouterr().out.strip().splitlines()  # node 1 runs rank 2 only
    for part in ("RANK=2 LOCAL_RANK=0 WORLD_SIZE=3", "MASTER_ADDR=host0 MASTER_PORT=29400",
                 "-m hetrain run", "--engine dist"):
        assert part in line
    assert "torch.distributed" not in line and "TORCHELASTIC" not in line


@pytest.mark.slow
def test_profile_measures_emulated_speeds(config, tmp_path) -> None:
    out, prof = tmp_path / "measured.toml", tmp_path / "profile.json"
    assert main(["profile", str(config), "--out", str(out), "--profile-out", str(prof),
                 "--steps", "5", "--quiet", "--set", "dist.time_scale=0.5"]) == 0
    cluster, profile = Cluster.load(out), Profile.load(prof)
    assert profile.source == "measured" and profile.n == 2
    slow, fast = profile.step_times_s()
    assert slow / fast == pytest.approx(3.8, rel=0.25)  # (2 ms + 155 ms) / (2 ms + 39 ms)
    assert cluster.devices[1].flops / cluster.devices[0].flops == pytest.approx(4, rel=0.3)
    assert all(d.link is not None for d in cluster.devices)
