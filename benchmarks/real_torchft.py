"""torchft LocalSGD / DiLoCo as peers in the real benchmark (optional dependency).

Every worker process is one torchft replica group of size 1: its own TCPStore (port 0), a
`torchft.Manager` (rank 0 of its group, so it runs the group's ManagerServer on an OS-chosen
port) with a reconfigurable `torchft.ProcessGroupGloo`, all joining one `LighthouseServer`
that the benchmark starts on 127.0.0.1 port 0 and shuts down after the run (`lighthouse`).
`min_replica_size` = number of workers, so every sync waits for all of them: synchronous, like
the other peers (no replica may drop out and no partial quorum forms). Quorums are synchronous
(`use_async_quorum=False`, which DiLoCo requires) and `init_sync=False`: every rank seeds the
model identically, so no weights are fetched from a peer at the first quorum.

- torchft_localsgd: `torchft.local_sgd.LocalSGD(sync_every=H)`: after every H optimizer steps
  a quorum, an all-reduce average of the parameters and a commit vote. Same algorithm as the
  torch PostLocalSGD peer; predicted by hetrain's local_sgd with local_steps=H.
- torchft_diloco: `torchft.local_sgd.DiLoCo(sync_every=H)`, one fragment: every H inner steps
  the pseudo-gradient (last global - local parameters) is averaged and the outer SGD (lr 0.7,
  momentum 0.9, Nesterov) steps the global parameters; predicted by hetrain's local_sgd with
  outer_lr=0.7, outer_momentum=0.9 (Nesterov), the same outer rule.

Inner optimizer, model, batch, data order, throttling and evaluation are `real_peers._train`'s:
the pad sleeps to the step's compute deadline after backward, before `optimizer.step()`, whose
post-hook is where torchft communicates, so a sync starts when the emulated device would have
finished its compute. The harness's own gloo group (barrier, stop flag) is separate from
torchft's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from hetrain.engine.emulate import sleep_until

SYSTEMS = {"torchft_localsgd": "local_sgd", "torchft_diloco": "diloco"}
"""peer name -> torchft algorithm."""
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
"""DiLoCo's outer Nesterov SGD (hetrain local_sgd outer_lr / outer_momentum)."""
TIMEOUT = timedelta(seconds=120)


def available() -> str | None:
    """None when torchft is importable, else why not (for the benchmark's note)."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install -r benchmarks/requirements.txt)"
    return None


@contextmanager
def lighthouse(n_replicas: int) -> Iterator[str]:
    """A LighthouseServer on 127.0.0.1 (OS-chosen port) needing all n replicas; its address.

    torchft reports the address with the machine's hostname; it is rewritten to 127.0.0.1,
    where the server listens."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info;
    from torchft.coordination import LighthouseServer  # the workers inherit this

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=n_replicas)
    try:
        port = server.address().rsplit(":", 1)[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()


class TorchftPeer:
    """One worker's replica group: its store, manager and LocalSGD/DiLoCo wrapper."""

    def __init__(self, run: Any, rank: int, lighthouse_addr: str, pad: Any) -> None:
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo, LocalSGD

        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self.run, self.pad = run, pad
        self.model = run.workload.build_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=run.lr, momentum=run.momentum)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=self._load,
            state_dict=self._state, min_replica_size=run.cluster.n, use_async_quorum=False,
            init_sync=False, timeout=TIMEOUT, quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT,
            rank=0, world_size=1, store_addr="127.0.0.1", store_port=self.store.port,
            lighthouse_addr=lighthouse_addr, replica_id=f"worker_{rank}", hostname="127.0.0.1")
        algo: Any
        if SYSTEMS[run.system] == "local_sgd":
            algo = LocalSGD(self.manager, self.model, self.opt, sync_every=run.period)
        else:
            outer = torch.optim.SGD(self.model.parameters(), lr=OUTER_LR,
                                    momentum=OUTER_MOMENTUM, nesterov=True)
            algo = DiLoCo(self.manager, [self.model], self.opt, outer, sync_every=run.period,
                          pin_memory=False)
        self.algo = algo.__enter__()

    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])

    def step(self, batch: Any) -> None:
        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        self.run.workload.loss_fn(self.model(x), y).backward()
        sleep_until(self.pad.deadline_s)  # compute padded before any sync leaves the rank
        self.opt.step()  # torchft's post-hook syncs every `period` steps

    def close(self) -> None:
        self.algo.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
