"""Several machines with `hetrain launch --nnodes 2` (hetrain.engine.nodes): two nodes on
127.0.0.1, a node killed, a node alone, SIGTERM, and (slow) two network namespaces.

Every process a test starts carries a tag in its environment; the `started` fixture kills
every process with that tag (and the network namespaces it made) whatever happens
(tests/procs.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from hetrain.cli import main
from hetrain.engine import nodes
from procs import (
    DEVICES,
    HETRAIN,
    SECRET,
    Started,
    alive,
    children,
    finish,
    free_port,
    tagged,
    wait_rows,
    write_trio,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

FAST_FIRST = '{ name = "c", flops = 8e7 }, { name = "a", flops = 4e7 }, { name = "b", flops = 4e7 }'


def write_config(tmp_path: Path, epochs: float = 4, devices: str = DEVICES) -> Path:
    return write_trio(tmp_path, "asp", epochs, devices)


def node(started: Started, config: Path, rank: int, master: str, runs: Path,
         *extra: str, netns: str = "", nproc: str = "2") -> subprocess.Popen:
    return started.start([*HETRAIN, "launch", str(config), "--nnodes", "2", "--node-rank",
                          str(rank), "--nproc-per-node", nproc, "--master", master,
                          "--runs-dir", str(runs), *extra], netns=netns)


def summary(runs: Path) -> dict:
    return json.loads((runs / "trio" / "summary.json").read_text())


# --- the layout and the command line (no processes) ----------------------------------------

def test_layout_ranks_and_environment() -> None:
    layout = nodes.Layout(nodes.parse_nproc_per_node("3,2,2", 3), 1, "10.0.0.1", 29400)
    assert layout.world_size == 7 and list(layout.ranks) == [3, 4]
    env = layout.env(4, "eth1")
    assert env["RANK"] == "4" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "7"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29400"
    assert env["GLOO_SOCKET_IFNAME"] == "eth1" and "TORCHELASTIC_USE_AGENT_STORE" not in env
    assert env.get("NCCL_SOCKET_IFNAME", "eth1") == "eth1"
    assert nodes.parse_nproc_per_node("2", 3) == (2, 2, 2)
    assert nodes.parse_endpoint("[::1]:29400") == ("::1", 29400)
    for bad in ("2,2", "0", "x"):
        with pytest.raises(Exception, match="--nproc-per-node"):
            nodes.parse_nproc_per_node(bad, 3)


def test_dry_run_prints_each_process_of_this_node(tmp_path, capsys) -> None:
    config = write_config(tmp_path)
    assert main(["launch", str(config), "--nnodes", "2", "--node-rank", "1",
                 "--nproc-per-node", "2", "--rdzv-endpoint", "host0:29400", "--ifname", "eth1",
                 "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("RANK=2 LOCAL_RANK=0 WORLD_SIZE=4 ")
    assert "MASTER_ADDR=host0 MASTER_PORT=29400 " in lines[1] and " GLOO_SOCKET_IFNAME=eth1 " in lines[1]
    assert "-m hetrain run" in lines[1] and "--engine dist" in lines[1]


@pytest.mark.parametrize(("args", "says"), [
    (["--nproc-per-node", "3"], "needs 4"),
    (["--nproc-per-node", "2", "--nproc", "4"], "--nproc counts"),
    (["--nproc-per-node", "2", "--port", "5"], "--port is"),
    (["--nproc-per-node", "2,1,1"], "3 counts for --nnodes 2"),
])
def test_multinode_mistakes_are_one_line(tmp_path, capsys, args, says) -> None:
    config = write_config(tmp_path)
    assert main(["launch", str(config), "--nnodes", "2", "--master", "h:1", "--dry-run",
                 *args]) == 2
    assert says in capsys.readouterr().err


def test_multinode_flags_on_one_machine_are_refused(tmp_path, capsys) -> None:
    assert main(["launch", str(write_config(tmp_path)), "--ifname", "eth0"]) == 2
    assert "only for several machines" in capsys.readouterr().err


def test_multinode_needs_the_secret(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("HETRAIN_SECRET", raising=False)
    monkeypatch.delenv("HETRAIN_SECRET_FILE", raising=False)
    assert main(["launch", str(write_config(tmp_path)), "--nnodes", "2", "--nproc-per-node",
                 "2", "--master", "127.0.0.1:1"]) == 2
    assert "HETRAIN_SECRET" in capsys.readouterr().err


def test_node0_needs_its_own_address_as_master(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HETRAIN_SECRET", SECRET)
    assert main(["launch", str(write_config(tmp_path)), "--nnodes", "2", "--nproc-per-node",
                 "2", "--master", "192.0.2.1:29400"]) == 2  # TEST-NET-1: nobody's address
    assert "not an address of this machine" in capsys.readouterr().err


# --- real processes ------------------------------------------------------------------------

@pytest.mark.slow
def test_two_nodes_reach_the_one_node_accuracy(tmp_path, started) -> None:
    """The one-node run and the two-node run side by side (their processes mostly sleep:
    the emulation pads every step to the cluster's time). ~32 s on 2 cores: ten processes
    import torch at once."""
    config = write_config(tmp_path)
    master = f"127.0.0.1:{free_port()}"
    one = started.start([*HETRAIN, "run", str(config), "--engine", "dist", "--no-plot",
                         "--runs-dir", str(tmp_path / "one"), "--quiet"])
    n1 = node(started, config, 1, master, tmp_path / "n1", nproc="2,2")
    n0 = node(started, config, 0, master, tmp_path / "n0", nproc="2,2")
    rc0, out0, err0 = finish(n0)
    rc1, out1, err1 = finish(n1)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert finish(one)[0] == 0
    assert "trio" in out0 and out1 == "", out1  # rank 0's table; node 1: no bogus results
    assert "Traceback" not in err0 + err1
    a, b = summary(tmp_path / "n0"), summary(tmp_path / "one")
    assert a["n_workers"] == 3 and a["lost_workers"] == []
    assert a["epochs"] == pytest.approx(b["epochs"], abs=0.1)
    assert a["tta_s"] is not None and b["tta_s"] is not None  # both reach the 90% target
    assert a["best_accuracy"] >= b["best_accuracy"] - 0.03
    assert not (tmp_path / "n1" / "trio").exists()  # only rank 0 writes the run


def test_killed_node_drops_its_workers_and_node0_finishes(tmp_path, started) -> None:
    """SIGKILL to node 1's supervisor: its processes die with it (pdeathsig), the server
    drops workers 1 and 2 and finishes with worker 0; node 0 exits right after."""
    config = write_config(tmp_path, epochs=2, devices=FAST_FIRST)
    master, runs = f"127.0.0.1:{free_port()}", tmp_path / "n0"
    n1 = node(started, config, 1, master, tmp_path / "n1")
    n0 = node(started, config, 0, master, runs, "--json")
    wait_rows(runs / "trio", 2, n0)
    ranks = children(n1.pid)
    assert len(ranks) == 2
    n1.kill()
    deadline = time.monotonic() + 5
    while [p for p in ranks if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in ranks if alive(p)], "node 1's processes outlived its supervisor"
    while n0.poll() is None and time.monotonic() < deadline + 90:
        time.sleep(0.05)
    ended = time.time()
    rc, out, err = finish(n0)
    assert rc == 0, err
    result = json.loads(out)[0]
    assert sorted(result["lost_workers"]) == [1, 2], err
    assert result["epochs"] == pytest.approx(2, abs=0.1)
    assert ended - (runs / "trio" / "summary.json").stat().st_mtime < 8  # no exit barrier


def test_node_alone_says_it_cannot_reach_node0(tmp_path, started) -> None:
    config = write_config(tmp_path)
    master = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    rc, _, err = finish(node(started, config, 1, master, tmp_path / "n1",
                               "--set", "dist.init_timeout_s=5"), 60)
    took = time.monotonic() - t0
    assert rc == 2
    assert err.strip().splitlines() == [  # what this node runs, then the one-line error
        "hetrain: node 1: rank 2 = device 'b', rank 3 = device 'c'",
        "hetrain: " + nodes.unreachable_message("node 1", master, 5)], err
    assert took < 5 + 8  # the command's own start (importing torch) plus the timeout
    assert tagged(started.tag) == []


@pytest.mark.slow
def test_node0_alone_says_once_that_the_others_never_joined(tmp_path, started) -> None:
    """Every rank of node 0 times out alike: one line (the node's first rank's), no c10d
    warnings, no per-rank exit lines."""
    config = write_config(tmp_path)
    master = f"127.0.0.1:{free_port()}"
    rc, _, err = finish(node(started, config, 0, master, tmp_path / "n0",
                             "--set", "dist.init_timeout_s=5"), 60)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("hetrain: node 0: rank 0 = the PS"), err
    assert lines[1].startswith("hetrain: error: rank 0: not all") and master in lines[1], err
    assert tagged(started.tag) == []


# Slow: by default test_faults.py's test_launch_drops_a_killed_worker_goes_on_and_checkpoints_on
# _sigterm sends SIGTERM to `hetrain launch` (checkpoint, 143, no orphans), and
# test_killed_node_drops_its_workers_and_node0_finishes runs `launch --nnodes 2`.
@pytest.mark.slow
def test_sigterm_to_node0_checkpoints_and_exits_143(tmp_path, started) -> None:
    config = write_config(tmp_path, epochs=8)
    master, runs = f"127.0.0.1:{free_port()}", tmp_path / "n0"
    n1 = node(started, config, 1, master, tmp_path / "n1")
    n0 = node(started, config, 0, master, runs, "--quiet")
    wait_rows(runs / "trio", 3, n0)
    n0.send_signal(signal.SIGTERM)
    rc, _, err = finish(n0, 60)
    assert rc == 143, err
    assert "stopped by SIGTERM" in err and "checkpoint.pt" in err and "Traceback" not in err
    assert (runs / "trio" / "checkpoint.pt").is_file()
    rc1, out1, err1 = finish(n1, 30)  # rank 0 stopped node 1's workers
    assert rc1 == 0 and out1 == "", err1


# --- two machines: network namespaces joined by a veth pair ---------------------------------

@pytest.fixture
def two_hosts(started) -> tuple[str, str]:
    """Namespaces ht0-* (10.231.7.1) and ht1-* (10.231.7.2), each with an interface named
    hteth, joined by a veth pair; deleted by `started` whatever happens."""
    suffix = uuid.uuid4().hex[:6]
    ns = (f"ht0-{suffix}", f"ht1-{suffix}")
    for name in ns:
        if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode:
            pytest.skip("cannot create network namespaces here (needs root and iproute2)")
        started.namespaces.append(name)
    steps = [["ip", "link", "add", f"hv0{suffix}", "netns", ns[0], "type", "veth", "peer",
              "name", f"hv1{suffix}", "netns", ns[1]]]
    for i, name in enumerate(ns):
        steps += [["ip", "-n", name, "link", "set", f"hv{i}{suffix}", "name", "hteth"],
                  ["ip", "-n", name, "addr", "add", f"10.231.7.{i + 1}/24", "dev", "hteth"],
                  ["ip", "-n", name, "link", "set", "hteth", "up"],
                  ["ip", "-n", name, "link", "set", "lo", "up"]]
    for step in steps:
        subprocess.run(step, check=True, capture_output=True)
    return ns


@pytest.mark.slow
def test_two_network_namespaces_run_to_the_end(tmp_path, started, two_hosts) -> None:
    config = write_config(tmp_path)
    master = "10.231.7.1:29400"
    n1 = node(started, config, 1, master, tmp_path / "n1", "--ifname", "hteth",
              netns=two_hosts[1])
    n0 = node(started, config, 0, master, tmp_path / "n0", "--ifname", "hteth", "--json",
              netns=two_hosts[0])
    rc0, out0, err0 = finish(n0)
    rc1, _, err1 = finish(n1)
    assert (rc0, rc1) == (0, 0), err0 + err1
    result = json.loads(out0)[0]
    assert result["lost_workers"] == [] and result["tta_s"] is not None
    assert result["epochs"] == pytest.approx(4, abs=0.1)


def test_each_node_says_which_devices_its_ranks_run() -> None:
    """The cluster file's device order decides the machine: rank r is device r - 1."""
    from hetrain.cli.launch import node_roles
    from hetrain.cluster import load_cluster

    devices = load_cluster("hetero-4").devices
    assert node_roles(range(0, 3), devices) == (
        f"rank 0 = the PS, rank 1 = device '{devices[0].name}', "
        f"rank 2 = device '{devices[1].name}'")
    assert node_roles(range(3, 6), devices).endswith("rank 5 = PS shard 1")


@pytest.mark.slow
def test_parallel_plan_across_two_network_namespaces(tmp_path, started, two_hosts) -> None:
    """examples/07_autoddl (one GPT over 4 devices by an AutoDDL plan, no parameter server) on
    two "machines", 2 ranks each: the start-up calibration and every step's collectives cross
    the veth link; rank r is device r (node 1 runs the two fast devices), and the run trains
    under the plan it would pick on one machine."""
    config = Path(__file__).parents[1] / "examples" / "07_autoddl" / "run.toml"
    master = "10.231.7.1:29400"
    short = ("--set", "stop.max_epochs=0.1", "--ifname", "hteth")
    n1 = node(started, config, 1, master, tmp_path / "n1", *short, netns=two_hosts[1])
    n0 = node(started, config, 0, master, tmp_path / "n0", *short, "--json",
              netns=two_hosts[0])
    rc0, out0, err0 = finish(n0)
    rc1, _, err1 = finish(n1)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert "Traceback" not in err0 + err1
    result = json.loads(out0)[0]
    par = result["parallel"]
    assert result["strategy"] == "parallel" and par["calibration"] is not None
    assert par["layout"] == "mesh 4 on devices [0, 1, 2, 3], batch shares [1, 1, 2, 4]"
    samples = [w["samples"] for w in result["workers"]]
    assert samples[3] == 4 * samples[0] == 2 * samples[2] > 0
    assert result["final_loss"] < 4.0  # ln(92) = 4.5 at the start
