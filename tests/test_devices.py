"""Device placement (hetrain.engine.devices) and mixed precision, on CPU with faked GPU counts.

The GPU paths themselves run in tests/gpu/ (skipped without CUDA) and scripts/gpu_check.sh.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hetrain.cluster import Device, load_cluster
from hetrain.config import DistConfig, OptimizerConfig, config_from_dict
from hetrain.engine import devices
from hetrain.engine.core import Replica
from hetrain.engine.devices import GpuInventory, Mover, host_tree, resolve
from hetrain.engine.dist import Rendezvous, check_devices
from hetrain.engine.precision import LossScaler
from hetrain.errors import ConfigError
from hetrain.strategies.base import WorkTask

NO_GPU = GpuInventory(False, 0)


def gpus(n: int) -> GpuInventory:
    return GpuInventory(True, n)


def test_gpus_go_to_cuda_and_auto_ranks_in_rank_order() -> None:
    kinds = ["cpu", "auto", "cuda", "auto", "cpu", "auto"]
    got = [str(resolve(r, r, len(kinds), kinds, gpus(2))) for r in range(len(kinds))]
    assert got == ["cpu", "cuda:0", "cuda:1", "cpu", "cpu", "cpu"]
    # the PS on a GPU shares the first one: one GPU serves rank 0 and one worker
    kinds = ["cuda", "cuda", "cpu"]
    assert [str(resolve(r, r, 3, kinds, gpus(1))) for r in range(3)] == ["cuda:0", "cuda:0", "cpu"]
    # no CUDA at all: auto falls back to the CPU, cuda is an error naming the rank
    assert [str(resolve(r, r, 2, ["cpu", "auto"], NO_GPU)) for r in range(2)] == ["cpu", "cpu"]
    with pytest.raises(ConfigError, match=r"worker 'a'.*'cuda'.*install a CUDA build"):
        resolve(1, 1, 2, ["cpu", "cuda"], NO_GPU, ["ps", "worker 'a'"])


def test_each_node_hands_out_its_own_gpus() -> None:
    """Two nodes of 3 ranks (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE): the second node's
    first GPU rank gets cuda:0 again."""
    kinds = ["cpu", "cuda", "cuda", "auto", "cuda", "cpu"]
    node = {r: (r % 3, 3) for r in range(6)}
    got = [str(resolve(r, *node[r], kinds, gpus(2))) for r in range(6)]
    assert got == ["cpu", "cuda:0", "cuda:1", "cuda:0", "cuda:1", "cpu"]


def test_too_many_gpu_workers_and_missing_gpus_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match=r"3 ranks on its node want a GPU.*has 2"):
        resolve(3, 3, 4, ["cpu", "cuda", "cuda", "cuda"], gpus(2))
    with pytest.raises(ConfigError, match=r"'cuda:3' does not exist.*2 GPUs visible"):
        resolve(1, 1, 2, ["cpu", "cuda:3"], gpus(2))
    assert resolve(1, 1, 2, ["cpu", "cuda:1"], gpus(2)) == torch.device("cuda", 1)


def test_torchrun_layout_comes_from_local_rank() -> None:
    assert Rendezvous(5, 8, "127.0.0.1", 1).layout == (5, 8)
    assert Rendezvous(5, 8, "127.0.0.1", 1, local_rank=1, local_world_size=4).layout == (1, 4)


def test_cluster_devices_name_their_torch_device(tmp_path) -> None:
    p = tmp_path / "mixed.toml"
    p.write_text('sites = [{ name = "s", lan = { bandwidth_Bps = 1e9 }, '
                 'wan = { bandwidth_Bps = 1e9 } }]\n'
                 'devices = [{ name = "gpu", flops = 1e12, torch_device = "cuda" },\n'
                 '           { name = "cpu", flops = 1e9, count = 2 }]\n')
    c = load_cluster(str(p))
    kinds, names = devices.rank_kinds(DistConfig(device="cpu"), c.devices)
    assert kinds == ["cpu", "cuda", "cpu", "cpu"] and names[1] == "worker 'gpu'"
    p.write_text(p.read_text().replace('"cuda"', '"tpu"'))
    with pytest.raises(ConfigError, match=r"torch_device.*'tpu' is not a device kind"):
        load_cluster(str(p))
    with pytest.raises(ConfigError, match=r"dist.device = 'gpu'"):
        DistConfig(device="gpu")


def test_rank0_checks_its_node_before_any_process_joins() -> None:
    cluster = load_cluster("hetero-4")
    cfg = config_from_dict({"engine": "dist", "dist": {"device": "cuda"}})
    with pytest.raises(ConfigError, match=r"4 ranks on its node want a GPU.*has 2"):
        check_devices(cfg, cluster, "ps", (0, 5), gpus(2))
    cfg = config_from_dict({"engine": "dist", "dist": {"device": "auto", "ps_device": "auto"}})
    assert check_devices(cfg, cluster, "ps", (0, 5), gpus(2)) == torch.device("cuda", 0)
    if not torch.distributed.is_nccl_available():
        cfg = config_from_dict({"engine": "dist", "dist": {"backend": "nccl"}})
        with pytest.raises(ConfigError, match=r"no NCCL"):
            check_devices(cfg, cluster, "allreduce", (0, 5), gpus(4))


def test_mover_and_host_tree_on_cpu_are_copies_for_the_wire() -> None:
    t = torch.arange(4.0)
    assert Mover(torch.device("cpu")).to_device(t) is t
    tree = host_tree({"state": {0: {"momentum_buffer": t}}, "param_groups": [{"lr": 0.1}]})
    moved = tree["state"][0]["momentum_buffer"]
    assert torch.equal(moved, t) and moved.data_ptr() != t.data_ptr()
    assert tree["param_groups"] == [{"lr": 0.1}]


def test_loss_scaler_skips_overflowed_steps_and_adapts() -> None:
    p = nn.Parameter(torch.zeros(2))
    s = LossScaler(True, init_scale=8.0, growth_interval=2)
    p.grad = torch.tensor([8.0, 16.0])
    assert s.unscale([p]) and torch.equal(p.grad, torch.tensor([1.0, 2.0]))
    p.grad = torch.tensor([math.inf, 1.0])
    assert not s.unscale([p]) and s.scale == 4.0 and s.skipped == 1
    for _ in range(2):
        p.grad = torch.ones(2)
        assert s.unscale([p])
    assert s.scale == 8.0
    off = LossScaler(False)
    loss = torch.tensor(3.0)
    assert off.scaled(loss) is loss and off.unscale([p])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_replica_trains_and_keeps_fp32_state(precision, mnist1d_cnn_small
                                                             ) -> None:
    """Autocast on CPU (bf16; fp16 with the loss scale): local SGD steps lower the loss as
    fp32 does, and parameters and updates stay fp32."""
    torch.manual_seed(0)
    wl = mnist1d_cnn_small
    rep = Replica(wl, wl.build_model(), OptimizerConfig(lr=0.05), precision=precision)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, len(wl.train), (32,), generator=gen) for _ in range(30)]
    first = rep.run(WorkTask(batch_size=32, local_steps=3), "delta", batches[:3]).loss
    for k in range(3, 30, 3):
        r = rep.run(WorkTask(batch_size=32, local_steps=3), "delta", batches[k:k + 3])
    assert r.update.dtype == torch.float32 and all(
        p.dtype == torch.float32 for p in rep.model.parameters())
    assert r.loss < first - 0.1, (first, r.loss)
    assert r.update.abs().sum() > 0
    assert rep.scaler.enabled == (precision == "fp16")


def test_cpu_only_cluster_devices_default_to_the_run_setting() -> None:
    d = Device("x", 1e9)
    assert d.torch_device is None
    kinds, _ = devices.rank_kinds(DistConfig(device="auto", ps_shards=2), (d, d))
    assert kinds == ["cpu", "auto", "auto", "cpu"]
