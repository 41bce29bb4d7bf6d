"""Who may join a run: the store listens on the configured address only, and a process that
takes a rank without the run's secret is refused before anything it sends is read."""

from __future__ import annotations

import contextlib
import multiprocessing as std_mp
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetrain.config import config_from_dict
from hetrain.engine import auth
from hetrain.engine.dist import Rendezvous, bind_listener, rendezvous_store, run_rank
from hetrain.errors import ConfigError
from procs import first_report

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

CLUSTER = {"name": "pair", "sites": [{"name": "s", "lan": {"bandwidth_Bps": 1e9},
                                      "wan": {"bandwidth_Bps": 1e9}}],
           "devices": [{"name": "a", "flops": 4e8}, {"name": "b", "flops": 4e8}]}


def _cfg() -> Any:
    return config_from_dict({
        "name": "auth", "engine": "dist", "cluster": CLUSTER,
        "workload": {"model": "mlp", "dataset": "digits"}, "strategy": {"name": "cadp"},
        "stop": {"max_epochs": 0.05}, "dist": {"emulate": "none", "init_timeout_s": 60}})


def _rank0(port: int, secret: str, out: Any) -> None:
    torch.set_num_threads(1)
    try:
        run_rank(Rendezvous(0, 3, "127.0.0.1", port, secret=secret), _cfg())
        out.put("finished")
    except ConfigError as e:
        out.put(f"refused: {e}")


def _worker(port: int, secret: str) -> None:
    torch.set_num_threads(1)
    with contextlib.suppress(Exception):  # rank 0 stops the run under it
        run_rank(Rendezvous(1, 3, "127.0.0.1", port, secret=secret), _cfg())


def _rogue(port: int, marker: str) -> None:
    """Takes rank 2 with a guessed secret, then sends what used to be a message: a pickle
    whose loading would create `marker`."""
    import pickle

    class Boom:
        def __reduce__(self) -> Any:
            return (Path(marker).touch, ())

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, False)
    dist.init_process_group("gloo", store=store, rank=2, world_size=3)
    with contextlib.suppress(Exception):
        auth.handshake(2, 3, "a guess")
    try:
        data = torch.frombuffer(bytearray(pickle.dumps(Boom())), dtype=torch.uint8)
        dist.send(torch.tensor([data.numel()]), 0)
        dist.send(data, 0)
    except Exception:
        pass


def test_rogue_rank_with_wrong_secret_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    listener = bind_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    listener.close()
    secret, marker = auth.new_secret(), str(tmp_path / "PWNED")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank0, args=(port, secret, out)),
             ctx.Process(target=_worker, args=(port, secret)),
             ctx.Process(target=_rogue, args=(port, marker))]
    verdict, _ = first_report(out, procs, 150)
    assert verdict.startswith("refused: rank 2 did not prove this run's secret"), verdict
    assert not Path(marker).exists()


def test_handshake_accepts_the_same_secret_and_refuses_another() -> None:
    """Both ways: rank 0 refuses a wrong proof, a rank refuses a rank 0 that answers wrong."""
    for peer_secret, expect in (("s3cret", "ok"), ("other", "refused")):
        probe = bind_listener("127.0.0.1", 0)
        port = probe.getsockname()[1]
        probe.close()
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_pair, args=(r, port, "s3cret" if r == 0 else peer_secret,
                                                 out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(20)
        assert results[0] == expect
        assert results[1] == expect


def _pair(rank: int, port: int, secret: str, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        auth.handshake(rank, 2, secret)
        out.put((rank, "ok"))
    except ConfigError:
        out.put((rank, "refused"))
    finally:
        dist.destroy_process_group()


def _serve_store(port: int, ready: Any, stop: Any) -> None:
    rv = Rendezvous(0, 2, "127.0.0.1", port)
    from datetime import timedelta

    store = rendezvous_store(rv, timedelta(seconds=30))
    ready.set()
    stop.wait(60)
    del store


def test_store_listens_on_the_configured_address_only() -> None:
    """torch's TCPStore listens on every interface; hetrain's on dist.master_addr."""
    ctx = std_mp.get_context("fork")
    probe = bind_listener("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    ready, stop = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_serve_store, args=(port, ready, stop))
    p.start()
    try:
        assert ready.wait(30)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the configured address answers
        with pytest.raises(OSError), \
                socket.create_connection(("127.0.0.2", port), timeout=5):
            pass  # another address of this machine does not (it would on the wildcard)
    finally:
        stop.set()
        p.join(10)
        if p.is_alive():
            p.kill()


def test_port_in_use_and_foreign_address_are_one_line_errors() -> None:
    held = bind_listener("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match="already in use"):
            bind_listener("127.0.0.1", held.getsockname()[1])
    finally:
        held.close()
    with pytest.raises(ConfigError, match=r"cannot listen on 192\.0\.2\.1|not an address"):
        bind_listener("192.0.2.1", 0)


def test_secret_file_must_be_private(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "secret"
    path.write_text("abc\n")
    path.chmod(0o644)
    monkeypatch.delenv(auth.ENV_SECRET, raising=False)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(path))
    with pytest.raises(ConfigError, match="readable by other users; chmod 600"):
        auth.configured_secret()
    path.chmod(0o600)
    assert auth.configured_secret() == "abc"
    monkeypatch.setenv(auth.ENV_SECRET, "from-env")
    assert auth.configured_secret() == "from-env"


def test_secret_file_for_torchrun_is_private_and_readable_back(tmp_path: Path) -> None:
    secret, path = auth.write_secret_file(tmp_path / "run")
    assert path.stat().st_mode & 0o077 == 0
    assert auth.read_secret_file(tmp_path / "run") == secret
    with pytest.raises(ConfigError, match="set HETRAIN_SECRET"):
        auth.read_secret_file(tmp_path / "elsewhere")
