"""Bad input to the `hetrain` CLI, as a user types it: one line, exit code 2, nothing written.

Every row is a command run as a subprocess in a fresh directory TMP: `python -m hetrain run
TMP/c.toml --runs-dir TMP/runs ...` on a tiny simulator workload (the MLP on digits, a fifth of
an epoch) with one thing wrong, or another subcommand given a bad argument. Each must fail
before it trains, spawns a process or writes a file: exit code 2, stderr exactly one line
`hetrain: error: ...` that names the problem (`says`), no traceback, and no file added under
TMP. The subprocesses of the selected rows run a few at a time (a module fixture starts them
all), since each pays for importing torch.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import tomli_w

INF, NAN = float("inf"), float("nan")
BASE: dict[str, Any] = {
    "name": "tiny", "cluster": "hetero-4", "engine": "sim",
    "workload": {"model": "mlp", "dataset": "digits"},
    "strategy": {"name": "local_sgd", "local_steps": 2},
    "train": {"batch_size": 16}, "stop": {"max_epochs": 0.2},
}
SITE = {"name": "s", "lan": {"bandwidth_Bps": 1e9}, "wan": {"bandwidth_Bps": 1e9}}


def _png(color: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def _random_bytes(n: int, seed: int = 0) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


class _Payload:
    """Unpickling this runs `touch PWNED` (what a crafted checkpoint would carry)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch PWNED",))


@dataclass(frozen=True)
class Case:
    id: str
    config: dict[str, Any] | str | bytes | None = field(default_factory=dict)
    """Merged over BASE (a key set to DROP is removed); str or bytes: the file as it is;
    None: no c.toml is written."""
    args: tuple[str, ...] = ()
    """After `run c.toml --runs-dir TMP/runs` (a later --runs-dir wins)."""
    says: str = ""
    """A fragment the error line must contain (what is wrong, or where)."""
    files: dict[str, str | bytes | None] = field(default_factory=dict)
    """Other files in TMP (None: a directory)."""
    argv: tuple[str, ...] | None = None
    """The whole command line instead of `run ...` (other subcommands)."""


DROP = object()


def cluster(**device: Any) -> dict[str, Any]:
    return {"cluster": {"sites": [SITE], "devices": [{"name": "d", "flops": 1e9, **device}]}}


def plan_argv(model: str, *extra: str) -> tuple[str, ...]:
    """`hetrain plan --cluster hetero-4 --model MODEL EXTRA...`."""
    return ("plan", "--cluster", "hetero-4", "--model", model, *extra)


def strategy(name: str, **options: Any) -> dict[str, Any]:
    return {"strategy": {"name": name, "local_steps": DROP, **options}}


RUN_CASES = [
    # every float finite and in its range
    Case("lr_inf", {"optimizer": {"lr": INF}}, says="optimizer.lr must be a finite number"),
    Case("lr_1e308", {"optimizer": {"lr": 1e308}}, says="optimizer.lr must be a positive number <= 1000"),
    Case("lr_zero", {"optimizer": {"lr": 0.0}}, says="optimizer.lr must be a positive number"),
    Case("lr_negative", {"optimizer": {"lr": -0.1}}, says="optimizer.lr"),
    Case("lr_nan", {"optimizer": {"lr": NAN}}, says="optimizer.lr must be a finite number"),
    Case("lr_string", {"optimizer": {"lr": "fast"}}, says="optimizer.lr must be of type float"),
    Case("momentum_one", {"optimizer": {"momentum": 1.0}}, says="optimizer.momentum must be in [0, 1)"),
    Case("momentum_negative", {"optimizer": {"momentum": -0.1}}, says="optimizer.momentum"),
    Case("weight_decay_inf", {"optimizer": {"weight_decay": INF}}, says="optimizer.weight_decay"),
    Case("nesterov_string", {"optimizer": {"nesterov": "yes"}}, says="optimizer.nesterov must be of type bool"),
    Case("max_epochs_inf", {"stop": {"max_epochs": INF}}, says="stop.max_epochs must be a finite number"),
    Case("max_epochs_zero", {"stop": {"max_epochs": 0}}, says="stop.max_epochs"),
    Case("max_epochs_bool", {"stop": {"max_epochs": True}}, says="stop.max_epochs must be of type float"),
    Case("max_time_inf", {"stop": {"max_time_s": INF}}, says="stop.max_time_s"),
    Case("target_accuracy_2", {"stop": {"target_accuracy": 2.0}}, says="stop.target_accuracy must be in [0, 1]"),
    Case("target_loss_inf", {"stop": {"target_loss": INF}}, says="stop.target_loss"),
    Case("time_scale_inf", {"dist": {"time_scale": INF}}, says="dist.time_scale must be a finite number"),
    Case("contention_k_inf", {"dist": {"contention_k": INF}}, says="dist.contention_k"),
    Case("worker_timeout_inf", {"dist": {"worker_timeout_s": INF}}, says="dist.worker_timeout_s"),
    Case("worker_timeout_negative", {"dist": {"worker_timeout_s": -1.0}}, says="dist.worker_timeout_s"),
    Case("init_timeout_zero", {"dist": {"init_timeout_s": 0.0}}, says="dist.init_timeout_s must be a positive number"),
    Case("threads_1e9", {"train": {"threads": 10**9}}, says="train.threads must be an integer >= 1 and <= 1024"),
    Case("eval_every_negative", {"train": {"eval_every_epochs": -1.0}}, says="train.eval_every_epochs"),
    Case("eval_every_s_inf", {"train": {"eval_every_s": INF}}, says="train.eval_every_s"),
    # integers: no floats, no bools, no strings, bounded
    Case("batch_float", {"train": {"batch_size": 16.5}}, says="train.batch_size must be of type int"),
    Case("batch_bool", {"train": {"batch_size": True}}, says="train.batch_size must be of type int"),
    Case("batch_string", {"train": {"batch_size": "16"}}, says="train.batch_size must be of type int"),
    Case("batch_huge", {"train": {"batch_size": 10**12}}, says="train.batch_size must be an integer >= 1"),
    Case("batch_over_train_set", {"train": {"batch_size": 100_000}}, says="larger than the training set"),
    Case("seed_negative", {"train": {"seed": -1}}, says="train.seed must be an integer >= 0"),
    Case("seed_float", {"train": {"seed": 1.5}}, says="train.seed"),
    Case("port_out_of_range", {"dist": {"port": 70000}}, says="dist.port"),
    Case("checkpoint_every_bool", {"train": {"checkpoint_every": True}}, says="train.checkpoint_every"),
    Case("checkpoint_every_old_and_new_place", {"dist": {"checkpoint_every": 2},
                                                "train": {"checkpoint_every": 3}},
         says="dist.checkpoint_every is the former name of train.checkpoint_every"),
    Case("ps_shards_float", {"dist": {"ps_shards": 2.0}}, says="dist.ps_shards"),
    Case("count_2.7", cluster(count=2.7), says="'count' must be an integer"),
    Case("count_1e8", cluster(count=100_000_000), says="<= 100000"),
    Case("count_string", cluster(count="3"), says="'count' must be an integer"),
    Case("count_zero", cluster(count=0), says="'count'"),
    Case("devices_total_too_many", {"cluster": {"sites": [SITE], "devices": [
        {"name": f"d{i}", "flops": 1e9, "count": 60_000} for i in range(2)]}},
        says="at most 100,000"),
    Case("flops_inf", cluster(flops=INF), says="flops must be a finite number"),
    Case("memory_inf", cluster(memory_bytes=INF), says="memory_bytes"),
    Case("step_overhead_inf", cluster(step_overhead_s=INF), says="step_overhead_s"),
    Case("bandwidth_string", {"cluster": {"sites": [{**SITE, "lan": {"bandwidth_Bps": "fast"}}],
                                          "devices": [{"name": "d", "flops": 1e9}]}},
         says="'bandwidth_Bps' must be a number"),
    Case("sites_not_array", {"cluster": {"sites": 3, "devices": [{"name": "d", "flops": 1e9}]}},
         says="'sites' must be an array of tables"),
    Case("devices_not_tables", {"cluster": {"sites": [SITE], "devices": ["d"]}},
         says="devices[0]: expected a table"),
    Case("site_name_int", {"cluster": {"sites": [{**SITE, "name": 3}], "devices": [
        {"name": "d", "flops": 1e9}]}}, says="'name' must be a non-empty string"),
    # wrong types and names at the top level
    Case("name_int", {"name": 3}, says="name must be a string"),
    Case("engine_bad", {"engine": "gpu"}, says="engine = 'gpu' is not allowed"),
    Case("cluster_int", {"cluster": 3}, says="cluster must be"),
    Case("cluster_preset_bad", {"cluster": "hetero-9"}, says="preset name"),
    Case("cluster_file_missing", {"cluster": "nosuch.toml"}, says="not found"),
    Case("cluster_file_binary", {"cluster": "cl.toml"}, files={"cl.toml": _random_bytes(300) + b"\0"},
         says="is a binary file"),
    Case("cluster_file_not_utf8", {"cluster": "cl.toml"}, files={"cl.toml": b"name = '\xe9'\n"},
         says="not UTF-8"),
    Case("model_int", {"workload": {"model": 3}}, says="workload.model must be of type str"),
    Case("model_unknown", {"workload": {"model": "transformerXL"}}, says="unknown model 'transformerXL'"),
    Case("dataset_unknown", {"workload": {"dataset": "imagenet"}}, says="unknown dataset 'imagenet'"),
    Case("section_not_table", "optimizer = 3\n", says="[optimizer] must be a table"),
    Case("unknown_top_level_key", {"colour": "red"}, says="unknown top-level key(s) ['colour']"),
    Case("unknown_section_key", {"train": {"batchsize": 3}}, says="unknown key(s) ['batchsize']"),
    Case("strategy_not_table", {"strategy": 3}, says="[strategy] must be a table with a 'name' key"),
    Case("emulate_bad", {"dist": {"emulate": "fast"}}, says="dist.emulate = 'fast' is not allowed"),
    # option tables: keys, types and ranges, against what takes them
    Case("model_option_unknown", {"workload": {"model_options": {"nosuch": 1}}},
         says="unknown option(s) ['nosuch'] for model 'mlp'; choose from: hidden"),
    Case("model_option_type", {"workload": {"model_options": {"hidden": "big"}}},
         says="workload.model_options.hidden (model 'mlp') must be a list of integers"),
    Case("model_option_float", {"workload": {"model_options": {"hidden": [12.5]}}},
         says="must be a list of integers"),
    Case("model_option_negative", {"workload": {"model_options": {"hidden": [-5]}}},
         says="workload.model_options.hidden[0] (model 'mlp') must be an integer >= 1"),
    Case("model_option_huge", {"workload": {"model_options": {"hidden": [10**11]}}},
         says="<= 16384"),
    Case("model_options_not_table", {"workload": {"model_options": 3}},
         says="workload.model_options must be a table"),
    Case("cnn_layers_zero", {"workload": {"model": "cnn", "model_options": {"layers": 0}}},
         says="workload.model_options.layers"),
    Case("resnet_norm_unknown", {"workload": {"model": "resnet", "model_options": {"norm": "layer"}}},
         says="unknown norm 'layer'"),
    Case("vgg_on_signals", {"workload": {"model": "vgg", "dataset": "mnist1d",
                                         "dataset_options": {"num_samples": 1000}}},
         says="'vgg' takes image inputs"),
    Case("gpt_heads_do_not_divide", {"workload": {"model": "gpt", "dataset": "text",
                                                  "model_options": {"n_embd": 30, "n_head": 4}}},
         says="divisible"),
    Case("text_needs_gpt", {"workload": {"dataset": "text"}}, says="dataset 'text' needs model 'gpt'"),
    Case("dataset_option_unknown", {"workload": {"dataset_options": {"nosuch": 1}}},
         says="unknown option(s) ['nosuch'] for dataset 'digits'; choose from: seed, test_fraction"),
    Case("test_fraction_2", {"workload": {"dataset_options": {"test_fraction": 2.0}}},
         says="workload.dataset_options.test_fraction (dataset 'digits')"),
    Case("dataset_seed_string", {"workload": {"dataset_options": {"seed": "x"}}},
         says="must be an integer"),
    Case("mnist1d_samples_huge", {"workload": {"dataset": "mnist1d",
                                               "dataset_options": {"num_samples": 10**12}}},
         says="num_samples"),
    Case("text_stride_zero", {"workload": {"model": "gpt", "dataset": "text",
                                           "dataset_options": {"stride": 0}}}, says="stride"),
    Case("text_patterns_string", {"workload": {"model": "gpt", "dataset": "text",
                                               "dataset_options": {"patterns": "*.py"}}},
         says="must be a list of strings"),
    Case("text_path_missing", {"workload": {"model": "gpt", "dataset": "text",
                                            "dataset_options": {"paths": "nope"}}},
         says="text: path 'nope' does not exist"),
    Case("text_corpus_binary", {"workload": {"model": "gpt", "dataset": "text",
                                             "dataset_options": {"paths": "t.txt"}}},
         files={"t.txt": _random_bytes(3000) + b"\0"}, says="text: 't.txt' is a binary file"),
    Case("imagefolder_needs_root", {"workload": {"dataset": "imagefolder"}},
         says="needs option(s) ['root']"),
    Case("imagefolder_root_missing", {"workload": {"dataset": "imagefolder",
                                                   "dataset_options": {"root": "nope"}}},
         says="root 'nope' does not exist"),
    Case("imagefolder_mean_length", {"workload": {"dataset": "imagefolder", "dataset_options": {
        "root": "imgs", "mean": [0.5]}}}, says="must have 3 entries"),
    Case("imagefolder_corrupt_image", {"workload": {"dataset": "imagefolder", "dataset_options": {
        "root": "imgs", "size": 8}}},
        files={"imgs/a/0.png": _png(), "imgs/a/1.png": _png(), "imgs/b/0.png": _png((9, 9, 9)),
               "imgs/b/1.png": _random_bytes(600), "imgs/b/2.png": _png((9, 9, 9))},
        says="imgs/b/1.png' is not a readable image"),
    Case("cifar10_root_missing", {"workload": {"model": "resnet", "dataset": "cifar10",
                                               "dataset_options": {"root": "nope"}}},
         says="cifar10: root 'nope' does not exist"),
    Case("strategy_option_unknown", {"strategy": {"nosuch": 1}},
         says="unknown option(s) ['nosuch'] for strategy 'local_sgd'; choose from: local_steps"),
    Case("strategy_option_string", {"strategy": {"local_steps": "x"}},
         says="strategy.local_steps (strategy 'local_sgd') must be an integer"),
    Case("strategy_option_float", {"strategy": {"local_steps": 2.5}}, says="must be an integer"),
    Case("strategy_option_huge", {"strategy": {"local_steps": 10**15}}, says="<= 10000"),
    Case("strategy_option_inf", {"strategy": {"outer_lr": INF}}, says="strategy.outer_lr"),
    Case("strategy_option_range", {"strategy": {"outer_lr": 5.0}}, says="strategy.outer_lr (strategy 'local_sgd') must be a positive number <= 2, got 5.0"),
    Case("strategy_unknown", {"strategy": {"name": "nosuch"}}, says="unknown strategy 'nosuch'"),
    Case("auto_hysteresis_inf", strategy("auto", hysteresis=INF), says="strategy.hysteresis"),
    Case("cadp_comm_fraction_nan", strategy("cadp", comm_fraction=NAN),
         says="strategy.comm_fraction"),
    Case("ssp_staleness_float", strategy("ssp", staleness=2.5), says="strategy.staleness"),
    Case("adsp_momentum_one", strategy("adsp", momentum=1.0), says="momentum"),
    Case("ashl_gap_huge", strategy("ashl", ahl_gap=10**18), says="strategy.ahl_gap"),
    Case("ashl_profile_missing", strategy("ashl", profile_path="nope.json"), says="nope.json"),
    Case("compression_unknown", {"train": {"compression": "zip"}},
         says="train.compression = 'zip' is not allowed"),
    Case("compression_option_unknown", {"train": {"compression": "topk",
                                                  "compression_options": {"k": 3}}},
         says="unknown option(s) ['k'] for compression 'topk'; choose from: ratio"),
    Case("compression_option_inf", {"train": {"compression": "topk",
                                              "compression_options": {"ratio": INF}}},
         says="train.compression_options.ratio"),
    Case("compress_pulls_without_feedback", {**strategy("asp"), "train": {
        "compression": "qsgd", "compress_pulls": True}}, says="train.compress_pulls"),
    # the config file itself
    Case("binary_file", _random_bytes(4096) + b"\0", says="is a binary file"),
    Case("not_utf8", b'name = "\xff\xfe"\n', says="not UTF-8 text (byte 0xff at offset 8)"),
    Case("not_toml", "[train\n", says="is not valid TOML"),
    Case("missing_config", None, says="not found"),
    Case("config_is_a_directory", None, files={"c.toml": None}, says="is a directory"),
    # names and paths: nothing is written outside the runs dir, or at all
    Case("name_slash", {"name": "a/b"}, says="contains '/'"),
    Case("name_dotdot", {"name": ".."}, says="would write outside the runs directory"),
    Case("name_parent_path", {"name": "../escape"}, says="not a path"),
    Case("name_absolute", {"name": "/tmp/abs"}, says="not a path"),
    Case("name_backslash", {"name": "a\\b"}, says="contains"),
    Case("name_empty", {"name": ""}, says="name must not be empty"),
    Case("name_newline", {"name": "a\nb"}, says="contains"),
    Case("runs_dir_is_a_file", args=("--runs-dir", "afile"), files={"afile": "x"},
         says="'afile' is a file, not a directory"),
    Case("runs_dir_under_a_file", args=("--runs-dir", "afile/runs"), files={"afile": "x"},
         says="'afile' is a file, so the directory cannot be created"),
    Case("run_dir_is_a_file", files={"runs/tiny": "x"}, says="runs/tiny' is a file"),
    # the command line
    Case("set_unknown_key", args=("--set", "stop.nosuch=1"), says="unknown key(s) ['nosuch']"),
    Case("set_strategy_nosuch", args=("--set", "strategy.name=nosuch"),
         says="unknown strategy 'nosuch'"),
    Case("set_lr_inf", args=("--set", "optimizer.lr=inf"), says="optimizer.lr"),
    Case("set_name_path", args=("--set", "name=../x"), says="not a path"),
    Case("set_without_equals", args=("--set", "stop"), says="expected KEY=VALUE"),
    Case("set_into_a_value", args=("--set", "cluster.x=1"), says="'cluster' is not a section"),
    Case("compare_unknown", args=("--compare", "nosuch"),
         says="--compare: unknown strategy 'nosuch'"),
    Case("compare_alone_bad_cluster", {"cluster": "hetero-9"}, args=("--compare", "fastest-alone"),
         says="preset name"),
    Case("resume_on_the_simulator", args=("--resume",), says="there is no checkpoint"),
    Case("resume_without_checkpoint", args=("--engine", "dist", "--resume"),
         says="there is no checkpoint"),
    # checkpoints that are not what a run wrote (benchmarks/probe_inputs.py found these)
    Case("resume_empty_checkpoint", args=("--resume",), files={"runs/tiny/checkpoint.pt": b""},
         says="runs/tiny/checkpoint.pt' cannot be read (EOFError)"),
    Case("resume_raw_pickle_checkpoint", args=("--resume",),
         files={"runs/tiny/checkpoint.pt": pickle.dumps(_Payload())},
         says="refused unread by the weights-only reader, so nothing in it ran"),
    Case("engine_flag_bad", args=("--engine", "gpu"), says="argument --engine: invalid choice"),
    Case("unknown_flag", args=("--fast",), says="unrecognized arguments: --fast"),
    # dist: PS shards that cannot work fail before any process is spawned
    Case("ps_shards_100_on_4_devices", {**strategy("asp"), "engine": "dist",
                                        "dist": {"ps_shards": 100}},
         says="dist.ps_shards = 100 is more parameter-server shards than the cluster"),
    Case("ps_shards_with_allreduce", {"engine": "dist", "dist": {"ps_shards": 2}},
         says="strategy 'local_sgd' all-reduces"),
    Case("ps_shards_over_tensors", {**strategy("asp"), "engine": "dist", "cluster": "hetero-8",
                                    "dist": {"ps_shards": 8}},
         says="the model has only 6 parameter tensors"),
    Case("ps_shards_via_engine_flag", {**strategy("asp"), "dist": {"ps_shards": 100}},
         args=("--engine", "dist"), says="dist.ps_shards = 100"),
]

OTHER_CASES = [
    Case("plan_needs_args", argv=("plan",), says="needs --cluster and --model"),
    Case("plan_model_unknown", argv=plan_argv("nosuch"),
         says="unknown model 'nosuch'"),
    Case("plan_option_string", argv=plan_argv("gpt", "--model-option", "n_layer=x"),
         says="bad model option"),
    Case("plan_option_negative", argv=plan_argv("gpt", "--model-option", "n_layer=-1"),
         says="n_layer"),
    Case("plan_option_huge", argv=plan_argv("gpt", "--model-option", "n_layer=1000000000"),
         says="n_layer"),
    Case("plan_heads_zero", argv=plan_argv("gpt", "--model-option", "n_head=0"), says="n_head"),
    Case("plan_heads_do_not_divide", argv=plan_argv("gpt", "--model-option", "n_head=3"),
         says="divisible"),
    Case("plan_option_unknown", argv=plan_argv("gpt", "--model-option", "depth=3"),
         says="unknown model option(s) ['depth']"),
    Case("plan_vgg_image_zero", argv=plan_argv("vgg", "--model-option", "image=0,0,0"),
         says="image[0]"),
    Case("plan_mlp_input_zero", argv=plan_argv("mlp", "--model-option", "input_shape=0"),
         says="input_shape[0]"),
    Case("plan_mlp_classes_zero", argv=plan_argv("mlp", "--model-option", "num_classes=0"),
         says="num_classes"),
    Case("plan_mlp_input_huge", argv=plan_argv("mlp", "--model-option", "input_shape=100000,100000"),
         says="too large"),
    Case("plan_batch_zero", argv=plan_argv("gpt", "--batch", "0"), says="--batch"),
    Case("plan_batch_huge", argv=plan_argv("gpt", "--batch", str(10**15)), says="--batch"),
    Case("plan_restarts_huge", argv=plan_argv("gpt", "--restarts", str(10**9)), says="--restarts"),
    Case("plan_optimizer_states_inf", argv=plan_argv("gpt", "--optimizer-states", "inf"),
         says="--optimizer-states must be a finite number"),
    Case("plan_optimizer_states_nan", argv=plan_argv("gpt", "--optimizer-states", "nan"),
         says="--optimizer-states"),
    Case("plan_cluster_binary", argv=("plan", "--cluster", "cl.toml", "--model", "gpt"),
         files={"cl.toml": _random_bytes(500) + b"\0"}, says="binary"),
    Case("plan_out_is_a_directory", argv=plan_argv("gpt", "--out", "o"), files={"o": None}, says="is a directory"),
    Case("plan_out_in_missing_directory", argv=plan_argv("gpt", "--out", "no/such/plan.json"),
         says="does not exist"),
    Case("plan_batch_not_int", argv=("plan", "--batch", "x"), says="invalid int value"),
    Case("goodput_missing_config", argv=("plan", "--goodput", "missing.toml"), says="not found"),
    Case("goodput_binary_config", argv=("plan", "--goodput", "c.toml"),
         config=_random_bytes(300) + b"\0", says="binary"),
    Case("goodput_bad_option", argv=("plan", "--goodput", "c.toml"),
         config={"workload": {"model_options": {"hidden": [-1]}}}, says="hidden[0]"),
    Case("goodput_noise_scale_inf", argv=("plan", "--goodput", "--noise-scale", "inf"),
         says="--noise-scale must be a finite number"),
    Case("report_nowhere", argv=("report", "nowhere"), says="is not a run directory"),
    Case("report_summary_not_json", argv=("report", "r"), files={"r/summary.json": "{not json"},
         says="is not valid JSON"),
    Case("report_summary_binary", argv=("report", "r"),
         files={"r/summary.json": _random_bytes(300) + b"\0"}, says="binary"),
    Case("report_summary_not_object", argv=("report", "r"), files={"r/summary.json": "[1, 2]"},
         says="not a JSON object"),
    Case("report_metrics_damaged", argv=("report", "r"),
         files={"r/summary.json": "{}", "r/metrics.jsonl": "{bad\n"}, says="line 1"),
    Case("report_summary_wrong_types", argv=("report", "r"),
         files={"r/summary.json": '{"tta_s": "soon"}'}, says="'tta_s' is 'soon', not a number"),
    Case("report_workers_not_objects", argv=("report", "r"),
         files={"r/summary.json": '{"workers": [3]}'}, says="'workers' is not a list of objects"),
    Case("report_metrics_row_missing_keys", argv=("report", "r", "--out", "o"),
         files={"r/summary.json": '{"name": "r"}', "r/metrics.jsonl": '{"time_s": 1}\n'},
         says="line 1 has no 'test_loss'"),
    Case("report_out_is_a_file", argv=("report", "r", "--out", "f"),
         files={"r/summary.json": '{"name": "r"}', "f": "x"}, says="'f' is a file"),
    Case("profile_missing_config", argv=("profile", "missing.toml"), says="not found"),
    Case("profile_steps_zero", argv=("profile", "c.toml", "--steps", "0"), says="--steps"),
    Case("profile_steps_huge", argv=("profile", "c.toml", "--steps", "1000000000"),
         says="--steps must be an integer >= 1 and <= 10000"),
    Case("profile_out_in_missing_directory", argv=("profile", "c.toml", "--out", "no/cl.toml",
                                                   "--profile-out", "no/p.json"),
         says="--out 'no/cl.toml': the directory 'no' does not exist"),
    Case("profile_runs_dir_is_a_file", argv=("profile", "c.toml", "--runs-dir", "f"),
         files={"f": "x"}, says="'f' is a file"),
    Case("profile_bad_set", argv=("profile", "c.toml", "--set", "optimizer.lr=inf"),
         says="optimizer.lr"),
    Case("launch_nproc_wrong", argv=("launch", "c.toml", "--nproc", "99"),
         says="the run needs 5 processes"),
    Case("launch_nnodes_negative", argv=("launch", "c.toml", "--nnodes", "-1"), says="--nnodes"),
    Case("launch_node_rank_out_of_range", argv=("launch", "c.toml", "--nnodes", "2",
                                                "--node-rank", "5"), says="--node-rank"),
    Case("launch_needs_endpoint", argv=("launch", "c.toml", "--nnodes", "2"),
         says="needs --master HOST:PORT"),
    Case("launch_port_out_of_range", argv=("launch", "c.toml", "--port", "70000"),
         says="dist.port"),
    Case("launch_runs_dir_is_a_file", argv=("launch", "c.toml", "--runs-dir", "f"),
         files={"f": "x"}, says="'f' is a file"),
    Case("launch_ps_shards_100", argv=("launch", "c.toml", "--set", "dist.ps_shards=100"),
         config=strategy("asp"), says="dist.ps_shards = 100"),
    Case("unknown_command", argv=("train",), says="invalid choice: 'train'"),
    Case("join_json_garbage", argv=("join", "c.toml"), config=strategy("asp"),
         files={"runs/tiny/join.json": _random_bytes(200)}, says="join.json is damaged"),
    Case("join_json_without_endpoint", argv=("join", "c.toml"), config=strategy("asp"),
         files={"runs/tiny/join.json": '{"host": 5}'}, says="join.json is damaged"),
]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if v is DROP:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _write(path: Path, content: str | bytes | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if content is None:
        path.mkdir(exist_ok=True)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


@dataclass
class Outcome:
    returncode: int
    stderr: str
    added: list[str]
    """Files under TMP that the command created."""


def _run(case: Case, tmp: Path) -> Outcome:
    cfg = tmp / "c.toml"
    if isinstance(case.config, dict):
        _write(cfg, tomli_w.dumps(_merge(BASE, case.config)))
    elif case.config is not None:
        _write(cfg, case.config)
    for name, content in case.files.items():
        _write(tmp / name, content)
    before = {p for p in tmp.rglob("*") if not p.is_dir()}
    argv = case.argv or ("run", str(cfg), "--runs-dir", str(tmp / "runs"), *case.args)
    r = subprocess.run([sys.executable, "-m", "hetrain", *argv], cwd=tmp, capture_output=True,
                       text=True, timeout=240)
    added = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")
                   if not p.is_dir() and p not in before)
    return Outcome(r.returncode, r.stderr, added)


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Outcome]]]:
    """Start the commands of every selected row of this module, a few at a time."""
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    workers = max(2, min(4, os.cpu_count() or 2))
    with ThreadPoolExecutor(workers) as pool:
        futures = {c.id: pool.submit(_run, c, tmp_path_factory.mktemp(c.id)) for c in selected}
        yield futures
        for f in futures.values():
            f.cancel()


def _check(case: Case, outcome: Outcome) -> None:
    lines = outcome.stderr.strip().splitlines()
    assert "Traceback" not in outcome.stderr, outcome.stderr
    assert outcome.returncode == 2, (outcome.returncode, outcome.stderr)
    assert len(lines) == 1, outcome.stderr
    assert lines[0].startswith("hetrain: error: "), lines[0]
    assert case.says in lines[0], lines[0]
    assert outcome.added == [], f"wrote {outcome.added}"


@pytest.mark.slow  # 175 subprocesses: about 9 minutes on 2 cores
@pytest.mark.parametrize("case", RUN_CASES, ids=[c.id for c in RUN_CASES])
def test_bad_run_input_is_one_line_exit_2_and_writes_nothing(
        case: Case, outcomes: dict[str, Future[Outcome]]) -> None:
    _check(case, outcomes[case.id].result())


@pytest.mark.slow
@pytest.mark.parametrize("case", OTHER_CASES, ids=[c.id for c in OTHER_CASES])
def test_bad_input_to_other_commands_is_one_line_exit_2(
        case: Case, outcomes: dict[str, Future[Outcome]]) -> None:
    _check(case, outcomes[case.id].result())


def test_a_checkpoint_damaged_on_disk_is_refused_by_its_checksum(tmp_path: Path) -> None:
    """torch's zip reader does not check its CRCs: a flipped byte in a tensor's record loads
    as a wrong weight unless the checkpoint's own digest catches it."""
    import torch

    from hetrain.engine.checkpoint import (
        ServerState,
        checkpoint_path,
        load_checkpoint,
        save_checkpoint,
    )
    from hetrain.errors import ConfigError
    from hetrain.strategies import make_strategy

    weight = torch.full((64, 64), 0.25)
    save_checkpoint(tmp_path, ServerState(
        model={"w": weight}, optimizer={}, version=1, strategy=make_strategy("asp"),
        owner=None, applied_samples=0, next_eval=0, elapsed_s=0.0, rows=[], workers=[],
        tta=(None, None), lost=[], config={}))
    assert load_checkpoint(tmp_path, "asp").model["w"].equal(weight)
    path = checkpoint_path(tmp_path)
    data = bytearray(path.read_bytes())
    at = bytes(data).index(weight.numpy().tobytes()[:64]) + 100  # inside the tensor's record
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="do not match their checksum"):
        load_checkpoint(tmp_path, "asp")


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in RUN_CASES + OTHER_CASES]
    assert len(ids) == len(set(ids))


def test_every_numeric_config_field_has_a_named_range() -> None:
    """A new int or float key of the run config must come with its range in FIELD_LIMITS."""
    import dataclasses

    from hetrain.config import _SECTIONS
    from hetrain.validate import FIELD_LIMITS

    numeric = {f"{section}.{f.name}" for section, cls in _SECTIONS.items()
               for f in dataclasses.fields(cls) if f.type in ("int", "float", int, float)}
    assert numeric == set(FIELD_LIMITS)
