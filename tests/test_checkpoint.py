"""Checkpoint files of the dist engine: round trip, atomic replace, clear errors."""

from __future__ import annotations

from dataclasses import replace

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


class _Payload:
    """Unpickling this runs code: what a crafted checkpoint would carry."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os
        return (os.system, ("touch PWNED",))


def test_checkpoint_crafted_to_run_code_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"format": 2, "tree": "{}", "tensors": [], "x": _Payload()},
               checkpoint_path(tmp_path))
    with pytest.raises(ConfigError, match=r"cannot be read.*crafted"):
        load_checkpoint(tmp_path, "local_sgd")
    assert not (tmp_path / "PWNED").exists()


def test_corrupt_or_foreign_file_is_one_clear_error(tmp_path) -> None:
    checkpoint_path(tmp_path).write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_checkpoint(tmp_path, "local_sgd")
    torch.save({"format": 2, "tree": '{"o": ["os.system", {}]}', "tensors": []},
               checkpoint_path(tmp_path))
    with pytest.raises(ConfigError, match="not allowed"):
        load_checkpoint(tmp_path, "local_sgd")


def test_file_holds_only_tensors_and_plain_data(tmp_path) -> None:
    save_checkpoint(tmp_path, _state())
    data = torch.load(checkpoint_path(tmp_path), weights_only=True)  # no pickled objects
    assert set(data) == {"format", "tree", "tensors", "digest"}
    assert isinstance(data["tree"], str) and isinstance(data["digest"], str)


@pytest.mark.parametrize("key, value, named", [
    ("workload", {"model": "mlp", "dataset": "digits"}, "workload"),
    ("cluster", "hetero-4", "cluster"),
    ("optimizer", {"name": "adam"}, "optimizer.name"),
])
def test_checkpoint_of_another_run_is_refused_by_name(tmp_path, key, value, named) -> None:
    from hetrain.config import config_from_dict
    base = {"cluster": "hetero-8", "workload": {"model": "cnn", "dataset": "mnist1d"}}
    written = config_from_dict(base).to_dict()
    save_checkpoint(tmp_path, replace(_state(), config=written))
    assert load_checkpoint(tmp_path, "local_sgd", written).version == 7
    other = config_from_dict({**base, key: value}).to_dict()
    with pytest.raises(ConfigError, match=f"written with {named} = .*resume with the same"):
        load_checkpoint(tmp_path, "local_sgd", other)
