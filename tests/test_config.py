from __future__ import annotations

import pytest

from hetrain.config import RunConfig, config_from_dict, load_config
from hetrain.errors import ConfigError
from hetrain.strategies import make_strategy


def test_defaults_and_full_file(tmp_path) -> None:
    p = tmp_path / "run.toml"
    p.write_text("""
cluster = "hetero-4"
[workload]
model = "mlp"
dataset = "digits"
[strategy]
name = "local_sgd"
local_steps = 4
[optimizer]
name = "adam"
lr = 1e-3
[stop]
max_epochs = 2
target_accuracy = 0.9
""")
    cfg = load_config(p)
    assert cfg.name == "run" and cfg.cluster == "hetero-4"
    assert cfg.strategy.options == {"local_steps": 4}
    assert cfg.optimizer.name == "adam" and cfg.stop.max_epochs == 2.0
    assert RunConfig().engine == "sim"


def test_relative_cluster_path_resolves_next_to_the_config(tmp_path) -> None:
    (tmp_path / "run.toml").write_text('cluster = "my_cluster.toml"\n')
    assert load_config(tmp_path / "run.toml").cluster == str(tmp_path / "my_cluster.toml")


@pytest.mark.parametrize("data, message", [
    ({"colour": "red"}, "unknown top-level key(s) ['colour']"),
    ({"train": {"batchsize": 3}}, "[train]: unknown key(s) ['batchsize']; allowed keys"),
    ({"train": {"batch_size": 0}}, "train.batch_size must be an integer >= 1"),
    ({"train": {"batch_size": "big"}}, "train.batch_size must be of type int"),
    ({"optimizer": {"name": "lion"}}, "optimizer.name = 'lion' is neither sgd, adam, adamw nor a torch.optim optimizer; choose one of: sgd, adam, adamw, ASGD"),
    ({"optimizer": {"lr": -1.0}}, "optimizer.lr must be a positive number"),
    ({"engine": "gpu"}, "engine = 'gpu' is not allowed; choose one of: sim, dist"),
    ({"stop": {"target_accuracy": 80}}, "stop.target_accuracy must be in [0, 1]"),
    ({"strategy": {"local_steps": 3}}, "[strategy] must be a table with a 'name' key"),
])
def test_bad_configs_name_the_key(data, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert message in str(e.value)


def test_strategy_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['steps'\]; allowed: \['local_steps'"):
        make_strategy("local_sgd", steps=3)
    with pytest.raises(ConfigError, match="unknown strategy 'fast'"):
        make_strategy("fast")
    with pytest.raises(ConfigError, match="strategy local_sgd: local_steps must be an integer >= 1 and <= 10000, got 0"):
        make_strategy("local_sgd", local_steps=0)


def test_missing_and_broken_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "none.toml")
    (tmp_path / "broken.toml").write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "broken.toml")
