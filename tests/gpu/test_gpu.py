"""The GPU paths of the real engine (skipped without CUDA; run by scripts/gpu_check.sh).

A GPU worker beside CPU workers, the PS on the GPU, NCCL among GPU workers, mixed precision,
and the profiler's synchronised timing: what tests/test_devices.py can only check with faked
GPU counts.
"""

from __future__ import annotations

import pytest
import torch

from hetrain.config import OptimizerConfig, config_from_dict
from hetrain.engine.core import Replica
from hetrain.runner import run_config
from hetrain.strategies.base import WorkTask

pytestmark = [pytest.mark.gpu, pytest.mark.dist, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MIXED = {"name": "mixed", "sites": [{"name": "s", "lan": {"bandwidth_Bps": 1e9},
                                     "wan": {"bandwidth_Bps": 1e9}}],
         "devices": [{"name": "gpu", "flops": 4e9, "torch_device": "cuda"},
                     {"name": "cpu", "flops": 1e9, "count": 2, "torch_device": "cpu"}]}


def cfg(strategy: str, cluster=MIXED, **dist):
    return config_from_dict({
        "name": f"gpu-{strategy}", "engine": "dist", "cluster": cluster,
        "workload": {"model": "cnn", "dataset": "mnist1d",
                     "dataset_options": {"num_samples": 4000}},
        "strategy": {"name": strategy}, "optimizer": {"lr": 0.05},
        "train": {"batch_size": 32, "eval_every_epochs": 0.25},
        "stop": {"max_epochs": 1.0},
        "dist": {"time_scale": 0.05, "worker_timeout_s": 60.0, **dist}})


@pytest.fixture
def no_tf32():
    """cuDNN convolutions default to TF32 (10-bit mantissa); compare in true fp32."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def test_replica_on_gpu_matches_cpu(mnist1d_cnn_small, no_tf32) -> None:
    """The same local steps on cuda and on the CPU give the same update (float tolerance)."""
    wl = mnist1d_cnn_small
    torch.manual_seed(0)
    model = wl.build_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [torch.arange(32) + 32 * k for k in range(3)]
    out = {}
    for device in ("cpu", "cuda"):
        m = wl.build_model()
        m.load_state_dict(state)
        rep = Replica(wl, m, OptimizerConfig(lr=0.05), torch.device(device))
        r = rep.run(WorkTask(batch_size=32, local_steps=3), "delta", batches)
        assert r.update.device.type == "cpu"
        out[device] = r
    assert torch.allclose(out["cpu"].update, out["cuda"].update, rtol=1e-3, atol=1e-4)
    assert out["cpu"].loss == pytest.approx(out["cuda"].loss, rel=1e-4)


def test_updates_come_back_through_pinned_memory() -> None:
    """A push's tensors leave the GPU into pinned host blocks, each its own, with the values
    the device held (the copy is awaited before the bytes are used)."""
    from hetrain.engine.devices import Mover

    mover = Mover(torch.device("cuda"))
    on_gpu = [torch.randn(1 << 20, device="cuda") for _ in range(3)]
    back = [mover.to_host(t) for t in on_gpu]
    for t, h in zip(on_gpu, back, strict=True):
        assert h.device.type == "cpu" and h.is_pinned()
        assert torch.equal(h, t.cpu())
    assert len({h.data_ptr() for h in back}) == 3
    plain = Mover(torch.device("cuda"), pin_memory=False).to_host(on_gpu[0])
    assert not plain.is_pinned() and torch.equal(plain, back[0])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_gpu_trains(precision, mnist1d_cnn_small) -> None:
    wl = mnist1d_cnn_small
    torch.manual_seed(0)
    rep = Replica(wl, wl.build_model(), OptimizerConfig(lr=0.05), torch.device("cuda"),
                  precision)
    losses = [rep.run(WorkTask(batch_size=32, local_steps=5), "delta",
                      [torch.randint(0, 3000, (32,)) for _ in range(5)]).loss for _ in range(8)]
    assert losses[-1] < losses[0] - 0.1, losses


def test_gpu_worker_beside_cpu_workers_with_ps_on_gpu(tmp_path, mnist1d_cnn_small) -> None:
    """cadp on 1 GPU + 2 CPU workers, the global model on the GPU too: trains, and the
    summary says where each rank ran."""
    r = run_config(cfg("cadp", ps_device="cuda"), runs_root=tmp_path,
                   workload=mnist1d_cnn_small)
    s = r.summary
    assert s["worker_devices"] == ["cuda:0", "cpu", "cpu"] and s["ps_device"] == "cuda:0"
    # one epoch of 3200 samples: the CPU engine and the simulator reach about 0.26 here
    losses = [row["test_loss"] for row in r.rows]
    assert s["final_accuracy"] > 0.15 and losses[-1] < losses[0] - 0.1, (s, losses)


def test_ddp_over_nccl_on_the_gpu(tmp_path, mnist1d_cnn_small) -> None:
    """ddp's all-reduce over an NCCL group (one GPU here: one worker) gives what the
    simulator computes for the same seed."""
    alone = {**MIXED, "devices": [MIXED["devices"][0]]}
    c = cfg("ddp", cluster=alone, backend="nccl")
    dist = run_config(c, runs_root=tmp_path, workload=mnist1d_cnn_small).summary
    sim = run_config(c.replace(engine="sim"), runs_root=None, workload=mnist1d_cnn_small).summary
    assert dist["worker_devices"] == ["cuda:0"]
    assert dist["updates"] == sim["updates"]
    # the GPU's kernels round differently from the CPU's: close, not equal
    assert dist["final_accuracy"] == pytest.approx(sim["final_accuracy"], abs=0.03)


def test_nccl_with_a_cpu_worker_is_one_clear_error(tmp_path, mnist1d_cnn_small) -> None:
    from hetrain.errors import ConfigError
    with pytest.raises(ConfigError, match=r"worker 'cpu-0' computes on cpu.*nccl"):
        run_config(cfg("ddp", backend="nccl"), runs_root=tmp_path, workload=mnist1d_cnn_small)
