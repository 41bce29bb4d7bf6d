"""Turn a RunConfig into the live pieces an engine needs (shared by sim, dist and the API)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from hetrain.cluster import Cluster, load_cluster
from hetrain.compress import Compressor, make_compressor
from hetrain.config import RunConfig
from hetrain.engine.core import model_bytes
from hetrain.errors import ConfigError
from hetrain.strategies import RunContext, Strategy, make_strategy
from hetrain.workloads import Workload, flops_per_sample, workload_from_config


@dataclass
class Prepared:
    cfg: RunConfig
    cluster: Cluster
    workload: Workload
    strategy: Strategy
    compressor: Compressor
    ctx: RunContext


def prepare(cfg: RunConfig, *, cluster: Cluster | None = None, workload: Workload | None = None,
            strategy: Strategy | None = None) -> Prepared:
    """Build (or take the given) cluster, workload and strategy, and set the strategy up."""
    torch.set_num_threads(cfg.train.threads)
    cluster = cluster or load_cluster(cfg.cluster)
    workload = workload or workload_from_config(cfg.workload)
    strategy = strategy or make_strategy(cfg.strategy.name, **cfg.strategy.options)
    compressor = make_compressor(cfg.train.compression, **cfg.train.compression_options)
    n_train = len(workload.train)  # type: ignore[arg-type]
    if n_train < cfg.train.batch_size:
        raise ConfigError(f"train.batch_size = {cfg.train.batch_size} is larger than the "
                          f"training set ({n_train} samples)")
    torch.manual_seed(cfg.train.seed)
    probe = workload.build_model()
    ctx = RunContext(cluster=cluster, flops_per_sample=flops_per_sample(workload),
                     model_bytes=model_bytes(probe), sample_bytes=workload.sample_bytes,
                     train_samples=n_train, batch_size=cfg.train.batch_size, lr=cfg.optimizer.lr,
                     optimizer=cfg.optimizer.name)
    strategy.setup(ctx)
    site = strategy.ps_placement()
    if site and site != cluster.ps_site:
        if cfg.engine == "dist":
            logging.getLogger("hetrain").warning(
                "strategy %s places the parameter server in site '%s' (the cluster file says "
                "'%s'): start rank 0 on a machine there; emulated links follow the plan",
                strategy.name, site, cluster.ps_site)
        cluster = dataclasses.replace(cluster, ps_site=site)
    return Prepared(cfg, cluster, workload, strategy, compressor, ctx)
