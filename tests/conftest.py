"""Shared test set-up: one intra-op thread (many tiny models; 2-core CI) and small workloads."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every `dist` test starts processes: mark it `multiproc` too, so that `make test-fast`
    (-m 'not slow and not multiproc') needs one marker and no test file lists both."""
    for item in items:
        if item.get_closest_marker("dist") is not None:
            item.add_marker(pytest.mark.multiproc)


@pytest.fixture(scope="session")
def digits_mlp():
    """A small, fast classification workload (sklearn digits, MLP)."""
    from hetrain.workloads import get_workload

    return get_workload("mlp", "digits")


@pytest.fixture(scope="session")
def mnist1d_cnn_small():
    """MNIST-1D CNN with a few thousand samples: real but quick."""
    from hetrain.workloads import get_workload

    return get_workload("cnn", "mnist1d", dataset_options={"num_samples": 4000})


@pytest.fixture(scope="session")
def mnist1d_cnn():
    """MNIST-1D CNN at its default size (16000 training samples): an epoch long enough that a
    geo-16 worker's one-step round fits in a quarter of it (~6 s to generate)."""
    from hetrain.workloads import get_workload

    return get_workload("cnn", "mnist1d")


@pytest.fixture
def started():
    """Processes a test starts (tests/procs.py): every one is killed after the test."""
    from procs import Started

    s = Started()
    try:
        yield s
    finally:
        s.kill_all()
