"""Checkpoint files of the dist engine: round trip, atomic replace, clear errors."""

from __future__ import annotations

import pytest
import torch

from hetrain.engine.checkpoint import (
    ServerState,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)
from hetrain.engine.core import DataOwner
from hetrain.errors import ConfigError
from hetrain.strategies import make_strategy


def _state(strategy_name: str = "local_sgd") -> ServerState:
    owner = DataOwner(100, seed=3)
    owner.take(30)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return ServerState(model=model.state_dict(), optimizer=opt.state_dict(), version=7,
                       strategy=make_strategy(strategy_name), owner=owner, applied_samples=30,
                       next_eval=50, elapsed_s=1.5, rows=[{"time_s": 0.0}], workers=[],
                       tta=(None, None), lost=[1], config={})


def test_round_trip_keeps_data_owner_position_and_optimizer(tmp_path) -> None:
    st = _state()
    save_checkpoint(tmp_path, st)
    back = load_checkpoint(tmp_path, "local_sgd")
    assert back.version == 7 and back.applied_samples == 30
    assert torch.equal(back.owner.take(10), st.owner.take(10))  # same stream from here on
    assert back.optimizer["state"][0]["momentum_buffer"].shape == (2, 3)
    assert not checkpoint_path(tmp_path).with_suffix(".pt.tmp").exists()


def test_other_strategy_or_missing_file_is_a_clear_error(tmp_path) -> None:
    save_checkpoint(tmp_path, _state())
    with pytest.raises(ConfigError, match=r"strategy 'local_sgd'.*'ddp'"):
        load_checkpoint(tmp_path, "ddp")
    with pytest.raises(ConfigError, match="no checkpoint"):
        load_checkpoint(tmp_path / "elsewhere", "local_sgd")
    with pytest.raises(ConfigError, match="run directory"):
        load_checkpoint(None, "local_sgd")
