"""Bad-input and quick-fault probes of the `hetrain` CLI, as a fair but adversarial user tries
them (issue 14's "Why" and "Inputs" cases, plus more): the figure "probes tried / handled
cleanly".

    PYTHONPATH=src .venv/bin/python benchmarks/probe_inputs.py [--jobs 2] [--only SUBSTR]
                                                              [--out probe_inputs]

Every probe runs the real CLI (`python -m hetrain ...`) in a subprocess, in a fresh temporary
directory (the command's working directory is TMP/a/b, so a name like `../../x` still lands
inside TMP, where it is seen), with a timeout; the process group is killed when it runs out.
Runs are tiny: the simulator, the MLP on digits, hetero-4, 0.05 epochs.

A probe that expects an error (exit 2, the default) is handled cleanly when the exit code is 2,
stderr has exactly ONE non-blank line (nothing is filtered: no warning is excused), the output
has no "Traceback", and no file under TMP was added, removed or changed (a crafted checkpoint's
payload would add one). A probe that expects the command to work (exit 0: a port held on
another loopback address, `--resume` of a finished run) is clean when it exits 0 without a
traceback in time. Some probes need a finished run to start from (resume with a corrupt or
mismatched checkpoint): one run of the base config is made first and copied into each.

Writes benchmarks/results/<out>.json and .md: the command, every probe (name, what it changes,
the command, exit code, first stderr line, verdict) and the totals tried / handled cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).parent / "results"
INF, NAN = float("inf"), float("nan")
BASE: dict[str, Any] = {
    "name": "tiny", "cluster": "hetero-4", "engine": "sim",
    "workload": {"model": "mlp", "dataset": "digits"},
    "strategy": {"name": "cadp"},
    "optimizer": {"name": "sgd", "lr": 0.05},
    "train": {"batch_size": 16}, "stop": {"max_epochs": 0.05},
}
RUN = ("run", "c.toml", "--runs-dir", "runs")
"""The default command: `hetrain run c.toml --runs-dir runs` (in TMP/a/b)."""
DROP = object()
"""In a config diff: remove this key from BASE."""
SITE = {"name": "s", "lan": {"bandwidth_Bps": 1e9}, "wan": {"bandwidth_Bps": 1e9}}
DEVICE = {"name": "d", "flops": 1e9}


@dataclass
class Probe:
    name: str
    area: str
    config: dict[str, Any] | str | bytes | None = field(default_factory=dict)
    """Merged over BASE into c.toml (DROP removes a key); str/bytes: c.toml as it is; None: no
    c.toml."""
    args: tuple[str, ...] = ()
    """Appended to the default `run c.toml --runs-dir runs`."""
    argv: tuple[str, ...] | None = None
    """The whole command line instead (other subcommands). `{port}` is the held port."""
    files: dict[str, str | bytes | None] = field(default_factory=dict)
    """Other files under TMP/a/b (None: a directory)."""
    setup: str = ""
    """'finished': copy a finished run of BASE into runs/tiny first; 'hold:ADDR': hold a
    listening port on ADDR for the command (its number is {port})."""
    expect: int = 2
    timeout: float = 90.0
    note: str = ""
    """What the probe tries, where the name does not say it."""
    edit: Callable[[Path], None] | None = None
    """Run on TMP/a/b after the setup (e.g. damage the checkpoint)."""


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


def _noise(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n) + b"\0"


def _png(color: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


class _Payload:
    """Unpickling this runs `touch PWNED` (what a crafted checkpoint would do)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch PWNED",))


def _crafted_torch_checkpoint(wd: Path) -> None:
    import torch

    torch.save({"format": 2, "x": _Payload()}, wd / "runs/tiny/checkpoint.pt")


def _crafted_raw_pickle(wd: Path) -> None:
    (wd / "runs/tiny/checkpoint.pt").write_bytes(pickle.dumps(_Payload()))


def _write_ckpt(content: bytes | None) -> Callable[[Path], None]:
    def edit(wd: Path) -> None:
        path = wd / "runs/tiny/checkpoint.pt"
        path.unlink()
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
    return edit


def _truncate_ckpt(wd: Path) -> None:
    path = wd / "runs/tiny/checkpoint.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_ckpt_bytes(wd: Path) -> None:
    path = wd / "runs/tiny/checkpoint.pt"
    data = bytearray(path.read_bytes())
    rng = random.Random(1)
    for i in rng.sample(range(len(data) // 4, len(data)), 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _other_format_ckpt(wd: Path) -> None:
    import torch

    torch.save({"format": 1, "model": {"w": torch.zeros(2)}}, wd / "runs/tiny/checkpoint.pt")


def _tensor_ckpt(wd: Path) -> None:
    import torch

    torch.save(torch.zeros(3), wd / "runs/tiny/checkpoint.pt")


def _edited_tree_ckpt(wd: Path) -> None:
    """A format-2 checkpoint whose tree names a type outside the codec's allowlist."""
    import torch

    path = wd / "runs/tiny/checkpoint.pt"
    data = torch.load(path, weights_only=True)
    data["tree"] = json.dumps({"__type__": "os.system", "args": ["touch PWNED"]})
    torch.save(data, path)


def cluster(*devices: dict[str, Any], sites: Any = None, **top: Any) -> dict[str, Any]:
    return {"cluster": {"sites": [SITE] if sites is None else sites,
                        "devices": list(devices) or [DEVICE], **top}}


def cluster_file(text: str | bytes) -> dict[str, Any]:
    """A probe config whose cluster is the file cl.toml with this content."""
    return {"config": {"cluster": "cl.toml"}, "files": {"cl.toml": text}}


GOOD_CLUSTER = ('[[sites]]\nname = "s"\nlan = { bandwidth_Bps = 1e9 }\n'
                'wan = { bandwidth_Bps = 1e9 }\n')


def probes() -> list[Probe]:
    P = Probe
    num = "numbers"
    out: list[Probe] = [
        # ---- non-finite, huge, wrong-kind numbers (issue: lr = inf trains to NaN, ...)
        P("lr_inf", num, {"optimizer": {"lr": INF}}),
        P("lr_1e308", num, {"optimizer": {"lr": 1e308}}),
        P("lr_nan", num, {"optimizer": {"lr": NAN}}),
        P("lr_negative", num, {"optimizer": {"lr": -0.05}}),
        P("lr_string", num, {"optimizer": {"lr": "0.05"}}),
        P("lr_minus_inf_via_set", num, args=("--set", "optimizer.lr=-inf")),
        P("momentum_1.5", num, {"optimizer": {"momentum": 1.5}}),
        P("weight_decay_negative", num, {"optimizer": {"weight_decay": -1.0}}),
        P("clip_grad_norm_nan", num, {"optimizer": {"clip_grad_norm": NAN}}),
        P("max_epochs_inf", num, {"stop": {"max_epochs": INF}}),
        P("max_epochs_1e308", num, {"stop": {"max_epochs": 1e308}}),
        P("max_epochs_negative", num, {"stop": {"max_epochs": -1.0}}),
        P("max_time_s_inf", num, {"stop": {"max_time_s": INF}}),
        P("target_accuracy_nan", num, {"stop": {"target_accuracy": NAN}}),
        P("target_accuracy_negative", num, {"stop": {"target_accuracy": -0.5}}),
        P("time_scale_inf", num, {"dist": {"time_scale": INF}}),
        P("time_scale_zero", num, {"dist": {"time_scale": 0.0}}),
        P("worker_timeout_inf", num, {"dist": {"worker_timeout_s": INF}}),
        P("init_timeout_inf", num, {"dist": {"init_timeout_s": INF}}),
        P("init_timeout_1e308", num, {"dist": {"init_timeout_s": 1e308}}),
        P("contention_k_negative", num, {"dist": {"contention_k": -3.0}}),
        P("threads_1e9", num, {"train": {"threads": 10**9}}),
        P("threads_zero", num, {"train": {"threads": 0}}),
        P("batch_zero", num, {"train": {"batch_size": 0}}),
        P("batch_1e12", num, {"train": {"batch_size": 10**12}}),
        P("batch_float", num, {"train": {"batch_size": 16.0}}),
        P("seed_2_63", num, {"train": {"seed": 2**63 - 1}}),
        P("eval_every_epochs_zero", num, {"train": {"eval_every_epochs": 0.0}}),
        P("eval_every_epochs_1e-300", num, {"train": {"eval_every_epochs": 1e-300}},
          expect=0, note="an evaluation every 1e-300 epochs: at most one per update, so the "
          "run ends"),
        P("checkpoint_every_negative", num, {"train": {"checkpoint_every": -1}}),
        P("port_negative", num, {"dist": {"port": -1}}),
        P("port_65536", num, {"dist": {"port": 65536}}),
        P("ps_shards_zero", num, {"dist": {"ps_shards": 0}}),
        P("ps_shards_100_dist", num, {"engine": "dist", "strategy": {"name": "asp"},
                                      "dist": {"ps_shards": 100}},
          note="the issue: 103 processes were spawned before the error"),
        # ---- clusters: inline tables and files
        P("count_2.7", "cluster", cluster({**DEVICE, "count": 2.7})),
        P("count_1e8", "cluster", cluster({**DEVICE, "count": 100_000_000})),
        P("count_negative", "cluster", cluster({**DEVICE, "count": -2})),
        P("flops_negative", "cluster", cluster({**DEVICE, "flops": -1e9})),
        P("flops_zero", "cluster", cluster({**DEVICE, "flops": 0})),
        P("flops_nan", "cluster", cluster({**DEVICE, "flops": NAN})),
        P("flops_string", "cluster", cluster({**DEVICE, "flops": "1e9"})),
        P("memory_negative", "cluster", cluster({**DEVICE, "memory_bytes": -1})),
        P("step_overhead_inf", "cluster", cluster({**DEVICE, "step_overhead_s": INF})),
        P("bandwidth_nan", "cluster", cluster(sites=[{**SITE, "lan": {"bandwidth_Bps": NAN}}])),
        P("bandwidth_negative", "cluster",
          cluster(sites=[{**SITE, "wan": {"bandwidth_Bps": -1e9}}])),
        P("latency_inf", "cluster",
          cluster(sites=[{**SITE, "lan": {"bandwidth_Bps": 1e9, "latency_s": INF}}])),
        P("device_link_bandwidth_zero", "cluster",
          cluster({**DEVICE, "link": {"bandwidth_Bps": 0}})),
        P("duplicate_device_names", "cluster", cluster(DEVICE, DEVICE)),
        P("duplicate_site_names", "cluster", cluster(sites=[SITE, SITE])),
        P("device_in_unknown_site", "cluster", cluster({**DEVICE, "site": "nowhere"})),
        P("device_missing_flops", "cluster", cluster({"name": "d"})),
        P("device_missing_name", "cluster", cluster({"flops": 1e9})),
        P("device_name_int", "cluster", cluster({**DEVICE, "name": 7})),
        P("device_unknown_key", "cluster", cluster({**DEVICE, "speed": 3})),
        P("devices_empty", "cluster", {"cluster": {"sites": [SITE], "devices": []}}),
        P("sites_missing", "cluster", {"cluster": {"devices": [DEVICE]}}),
        P("site_missing_lan", "cluster", cluster(sites=[{"name": "s", "wan": SITE["wan"]}])),
        P("ps_site_unknown", "cluster", cluster(ps_site="elsewhere")),
        P("torch_device_bad", "cluster", cluster({**DEVICE, "torch_device": "tpu"})),
        P("cluster_bool", "cluster", {"cluster": True}),
        P("cluster_preset_unknown", "cluster", {"cluster": "hetero-5"}),
        P("cluster_file_missing", "cluster", {"cluster": "nosuch.toml"}),
        P("cluster_file_empty", "cluster", **cluster_file("")),
        P("cluster_file_toml_error", "cluster", **cluster_file("[[sites]\nname = 's'\n")),
        P("cluster_file_binary", "cluster", **cluster_file(_noise(400))),
        P("cluster_file_no_devices", "cluster", **cluster_file(GOOD_CLUSTER)),
        P("cluster_file_nan_bandwidth", "cluster", **cluster_file(
            GOOD_CLUSTER.replace("lan = { bandwidth_Bps = 1e9 }", "lan = { bandwidth_Bps = nan }")
            + '[[devices]]\nname = "d"\nflops = 1e9\n')),
        P("cluster_file_negative_speed", "cluster", **cluster_file(
            GOOD_CLUSTER + '[[devices]]\nname = "d"\nflops = -5e9\n')),
        P("cluster_file_wrong_types", "cluster", **cluster_file(
            GOOD_CLUSTER + '[[devices]]\nname = "d"\nflops = 1e9\nmemory_bytes = "16GB"\n')),
        P("cluster_file_is_a_directory", "cluster", {"cluster": "cl.toml"},
          files={"cl.toml": None}),
        P("cluster_path_traversal_dev_zero", "cluster", {"cluster": "/dev/zero"},
          timeout=60, note="a device file that never ends"),
        # ---- option tables
        P("model_unknown", "options", {"workload": {"model": "resnet9000"}}),
        P("model_option_unknown", "options", {"workload": {"model_options": {"depth": 3}}}),
        P("model_option_wrong_type", "options",
          {"workload": {"model_options": {"hidden": "64"}}}),
        P("model_option_huge", "options",
          {"workload": {"model_options": {"hidden": [2**40]}}}),
        P("model_options_array", "options", {"workload": {"model_options": [1, 2]}}),
        P("dataset_unknown", "options", {"workload": {"dataset": "mnist"}}),
        P("dataset_option_unknown", "options",
          {"workload": {"dataset_options": {"path": "x"}}}),
        P("test_fraction_2", "options",
          {"workload": {"dataset_options": {"test_fraction": 2.0}}}),
        P("test_fraction_zero", "options",
          {"workload": {"dataset_options": {"test_fraction": 0.0}}}),
        P("test_fraction_string", "options",
          {"workload": {"dataset_options": {"test_fraction": "half"}}}),
        P("model_for_other_inputs", "options", {"workload": {"model": "gpt"}},
          note="a text model on image data"),
        P("strategy_unknown", "options", {"strategy": {"name": "fedavg"}}),
        P("strategy_option_unknown", "options", {"strategy": {"speed": 2}}),
        P("strategy_option_wrong_type", "options", {"strategy": {"local_steps": "4"}}),
        P("strategy_option_negative", "options", {"strategy": {"local_steps": -4}}),
        P("strategy_option_inf", "options", {"strategy": {"comm_fraction": INF}}),
        P("strategy_name_missing", "options", {"strategy": {"name": DROP, "local_steps": 2}}),
        P("ssp_staleness_negative", "options", {"strategy": {"name": "ssp", "staleness": -1}}),
        P("ashl_profile_empty_file", "options",
          {"strategy": {"name": "ashl", "profile_path": "p.json"}}, files={"p.json": ""}),
        P("optimizer_unknown", "options", {"optimizer": {"name": "lion"}}),
        P("optimizer_options_unknown", "options",
          {"optimizer": {"name": "Adagrad", "options": {"speed": 3}}}),
        P("optimizer_options_nan", "options",
          {"optimizer": {"name": "Adagrad", "options": {"eps": NAN}}}),
        P("scheduler_unknown", "options", {"optimizer": {"scheduler": "WarpLR"}}),
        P("scheduler_option_missing", "options", {"optimizer": {"scheduler": "StepLR"}}),
        P("scheduler_option_inf", "options", {"optimizer": {
            "scheduler": "StepLR", "scheduler_options": {"step_size": 10, "gamma": INF}}}),
        P("compression_unknown", "options", {"train": {"compression": "gzip"}}),
        P("compression_ratio_2", "options", {"train": {
            "compression": "topk", "compression_options": {"ratio": 2.0}}}),
        P("precision_unknown", "options", {"train": {"precision": "fp8"}}),
        P("engine_unknown", "options", {"engine": "tpu"}),
        P("device_kind_unknown", "options", {"dist": {"device": "tpu"}}),
        P("backend_unknown", "options", {"dist": {"backend": "mpi2"}}),
        P("unknown_section", "options", {"training": {"batch_size": 3}}),
        P("parallel_plan_unknown", "options", {"parallel": {"plan": "magic"}}),
        # ---- data sets from files
        P("imagefolder_corrupt_image", "data", {"workload": {
            "dataset": "imagefolder", "dataset_options": {"root": "imgs", "size": 8}}},
          files={"imgs/a/0.png": _png((200, 0, 0)), "imgs/a/1.png": _png((210, 0, 0)),
                 "imgs/b/0.png": _png((0, 0, 200)), "imgs/b/1.png": _noise(700)}),
        P("imagefolder_truncated_image", "data", {"workload": {
            "dataset": "imagefolder", "dataset_options": {"root": "imgs", "size": 8}}},
          files={"imgs/a/0.png": _png((200, 0, 0)), "imgs/a/1.png": _png((210, 0, 0)),
                 "imgs/b/0.png": _png((0, 0, 200)), "imgs/b/1.png": _png((0, 0, 9))[:40]}),
        P("imagefolder_empty", "data", {"workload": {
            "dataset": "imagefolder", "dataset_options": {"root": "imgs"}}},
          files={"imgs": None}),
        P("imagefolder_one_class", "data", {"workload": {
            "dataset": "imagefolder", "dataset_options": {"root": "imgs", "size": 8}}},
          files={"imgs/a/0.png": _png((200, 0, 0)), "imgs/a/1.png": _png((210, 0, 0))}),
        P("imagefolder_root_is_a_file", "data", {"workload": {
            "dataset": "imagefolder", "dataset_options": {"root": "f"}}}, files={"f": "x"}),
        P("text_corpus_empty_file", "data", {"workload": {
            "model": "gpt", "dataset": "text", "dataset_options": {"paths": "t.txt"}}},
          files={"t.txt": ""}),
        P("text_corpus_binary", "data", {"workload": {
            "model": "gpt", "dataset": "text", "dataset_options": {"paths": "t.txt"}}},
          files={"t.txt": _noise(3000)}),
        # ---- the config file itself
        P("config_binary", "files", _noise(4096)),
        P("config_toml_error", "files", 'name = "tiny"\n[train\nbatch_size = 3\n'),
        P("config_duplicate_key", "files", 'name = "a"\nname = "b"\n'),
        P("config_missing", "files", None),
        P("config_is_a_directory", "files", None, files={"c.toml": None}),
        P("config_not_utf8", "files", b'name = "caf\xe9"\n'),
        P("config_huge", "files", "# " + "x" * 12_000_000 + "\n"),
        P("config_dev_zero", "files", argv=("run", "/dev/zero", "--runs-dir", "runs"),
          timeout=60),
        P("config_dev_null", "files", argv=("run", "/dev/null", "--runs-dir", "runs",
                                            "--set", "stop.max_epochs=-1"),
          note="an empty config (all defaults) with one bad override"),
        P("config_top_level_array", "files", "name = [1, 2]\n"),
        P("config_section_is_a_value", "files", 'train = "fast"\n'),
        # ---- names and paths
        P("name_dotdot_slash", "paths", {"name": "../../escape"}),
        P("name_slash", "paths", {"name": "a/b"}),
        P("name_backslash", "paths", {"name": "a\\b"}),
        P("name_dot", "paths", {"name": "."}),
        P("name_dotdot", "paths", {"name": ".."}),
        P("name_absolute", "paths", {"name": "/tmp/hetrain-probe-abs"}),
        P("name_nul", "paths", {"name": "a\0b"}),
        P("name_too_long", "paths", {"name": "n" * 300}),
        P("name_empty", "paths", {"name": ""}),
        P("runs_dir_is_a_file", "paths", args=("--runs-dir", "f"), files={"f": "x"}),
        P("runs_dir_under_a_file", "paths", args=("--runs-dir", "f/runs"), files={"f": "x"}),
        P("run_dir_is_a_file", "paths", files={"runs/tiny": "x"}),
        P("runs_dir_dev_null", "paths", args=("--runs-dir", "/dev/null")),
        # ---- resume (a finished run of BASE is copied in first)
        P("resume_no_checkpoint", "resume", args=("--resume",)),
        P("resume_corrupt_checkpoint", "resume", args=("--resume",), setup="finished",
          edit=_write_ckpt(_noise(5000))),
        P("resume_empty_checkpoint", "resume", args=("--resume",), setup="finished",
          edit=_write_ckpt(b"")),
        P("resume_truncated_checkpoint", "resume", args=("--resume",), setup="finished",
          edit=_truncate_ckpt),
        P("resume_bitflipped_checkpoint", "resume", args=("--resume",), setup="finished",
          edit=_flip_ckpt_bytes),
        P("resume_checkpoint_is_a_directory", "resume", args=("--resume",), setup="finished",
          edit=_write_ckpt(None)),
        P("resume_old_format_checkpoint", "resume", args=("--resume",), setup="finished",
          edit=_other_format_ckpt),
        P("resume_tensor_as_checkpoint", "resume", args=("--resume",), setup="finished",
          edit=_tensor_ckpt),
        P("resume_crafted_pickle_checkpoint", "resume", args=("--resume",), setup="finished",
          edit=_crafted_torch_checkpoint, note="torch.save of an object that runs `touch "
          "PWNED` when unpickled: PWNED must not appear"),
        P("resume_crafted_raw_pickle", "resume", args=("--resume",), setup="finished",
          edit=_crafted_raw_pickle, note="a plain pickle that runs `touch PWNED`"),
        P("resume_crafted_codec_tree", "resume", args=("--resume",), setup="finished",
          edit=_edited_tree_ckpt, note="a format-2 file naming os.system in its tree"),
        P("resume_other_model", "resume", {"workload": {"model_options": {"hidden": [16]}}},
          args=("--resume",), setup="finished"),
        P("resume_other_dataset", "resume", {"workload": {"dataset_options": {"seed": 5}}},
          args=("--resume",), setup="finished"),
        P("resume_other_cluster", "resume", {"cluster": "hetero-8"}, args=("--resume",),
          setup="finished"),
        P("resume_other_optimizer", "resume", {"optimizer": {"name": "adam", "lr": 1e-3}},
          args=("--resume",), setup="finished"),
        P("resume_other_strategy", "resume", {"strategy": {"name": "asp"}},
          args=("--resume",), setup="finished"),
        P("resume_sim_checkpoint_on_dist", "resume", args=("--resume", "--engine", "dist"),
          setup="finished"),
        P("resume_finished_run", "resume", args=("--resume", "--no-plot"), setup="finished",
          expect=0, note="the flag the old stop message advised now exists and works"),
        P("resume_launch_no_checkpoint", "resume", argv=("launch", "c.toml", "--resume",
                                                         "--runs-dir", "runs")),
        # ---- ports and addresses (engine dist)
        P("port_held_on_127.0.0.2", "dist", {"engine": "dist"},
          args=("--port", "{port}", "--no-plot"), setup="hold:127.0.0.2", expect=0,
          timeout=240, note="the run's store binds 127.0.0.1 only, so it runs and finishes"),
        P("port_held_on_127.0.0.1", "dist", {"engine": "dist"}, args=("--port", "{port}"),
          setup="hold:127.0.0.1"),
        P("port_held_on_wildcard", "dist", {"engine": "dist"}, args=("--port", "{port}"),
          setup="hold:0.0.0.0"),
        P("master_addr_not_here", "dist", {"engine": "dist",
                                           "dist": {"master_addr": "192.0.2.1"}}),
        P("master_addr_garbage", "dist", {"engine": "dist",
                                          "dist": {"master_addr": "no such host!"}}),
        P("ps_shards_with_ddp", "dist", {"engine": "dist", "strategy": {"name": "ddp"},
                                         "dist": {"ps_shards": 2}}),
        # ---- the run command line
        P("flag_typo_resum", "cli", args=("--resum",)),
        P("flag_unknown", "cli", args=("--fast",)),
        P("engine_flag_bad", "cli", args=("--engine", "gpu")),
        P("port_flag_text", "cli", args=("--port", "abc")),
        P("port_flag_negative", "cli", args=("--port", "-5")),
        P("port_flag_huge", "cli", args=("--port", "99999")),
        P("set_without_equals", "cli", args=("--set", "optimizer.lr")),
        P("set_unknown_section", "cli", args=("--set", "nosuch.key=1")),
        P("set_lr_nan", "cli", args=("--set", "optimizer.lr=nan")),
        P("set_threads_huge", "cli", args=("--set", "train.threads=1000000000")),
        P("set_name_traversal", "cli", args=("--set", "name=../../x")),
        P("compare_unknown", "cli", args=("--compare", "ddp,nosuch")),
        P("compare_empty_names", "cli", args=("--compare", ",,,"), expect=0,
          note="nothing to compare: runs the config alone"),
        P("no_subcommand_bad_flag", "cli", argv=("--frobnicate",)),
        P("unknown_subcommand", "cli", argv=("train", "c.toml")),
        # ---- hetrain plan
        P("plan_no_args", "plan", argv=("plan",)),
        P("plan_model_unknown", "plan", argv=("plan", "--cluster", "hetero-4", "--model", "x")),
        P("plan_cluster_missing_file", "plan",
          argv=("plan", "--cluster", "none.toml", "--model", "gpt")),
        P("plan_cluster_empty_file", "plan",
          argv=("plan", "--cluster", "cl.toml", "--model", "gpt"), files={"cl.toml": ""}),
        P("plan_batch_zero", "plan",
          argv=("plan", "--cluster", "hetero-4", "--model", "gpt", "--batch", "0")),
        P("plan_batch_negative", "plan",
          argv=("plan", "--cluster", "hetero-4", "--model", "gpt", "--batch", "-8")),
        P("plan_model_option_garbage", "plan", argv=(
            "plan", "--cluster", "hetero-4", "--model", "gpt", "--model-option", "===")),
        P("plan_model_option_inf", "plan", argv=(
            "plan", "--cluster", "hetero-4", "--model", "gpt", "--model-option", "n_embd=inf")),
        P("plan_out_is_a_directory", "plan", argv=(
            "plan", "--cluster", "hetero-4", "--model", "gpt", "--out", "d"), files={"d": None}),
        P("plan_goodput_missing_config", "plan", argv=("plan", "--goodput", "none.toml")),
        P("plan_goodput_noise_nan", "plan", argv=("plan", "--goodput", "c.toml",
                                                  "--noise-scale", "nan")),
        P("plan_goodput_noise_negative", "plan", argv=("plan", "--goodput", "c.toml",
                                                       "--noise-scale", "-1")),
        # ---- hetrain profile
        P("profile_missing_config", "profile", argv=("profile", "none.toml")),
        P("profile_steps_zero", "profile", argv=("profile", "c.toml", "--steps", "0")),
        P("profile_steps_1e9", "profile", argv=("profile", "c.toml", "--steps", "1000000000"),
          timeout=60, note="a billion timed steps: a range, or a profile that never ends"),
        P("profile_out_is_a_directory", "profile",
          argv=("profile", "c.toml", "--out", "d"), files={"d": None}),
        P("profile_out_in_missing_dir", "profile",
          argv=("profile", "c.toml", "--out", "no/such/cl.toml",
                "--profile-out", "no/such/p.json"), timeout=120),
        P("profile_bad_set", "profile", argv=("profile", "c.toml", "--set", "dist.port=-1")),
        # ---- hetrain report
        P("report_missing", "report", argv=("report", "nowhere")),
        P("report_empty_dir", "report", argv=("report", "r"), files={"r": None}),
        P("report_summary_empty", "report", argv=("report", "r"), files={"r/summary.json": ""}),
        P("report_summary_garbage", "report", argv=("report", "r"),
          files={"r/summary.json": _noise(300)}),
        P("report_summary_wrong_types", "report", argv=("report", "r"),
          files={"r/summary.json": json.dumps({"name": 3, "tta_s": "soon", "rows": 7})}),
        P("report_metrics_nan_rows", "report", argv=("report", "r", "--out", "o"),
          files={"r/summary.json": json.dumps({"name": "r"}),
                 "r/metrics.jsonl": '{"time_s": "x", "test_accuracy": [1]}\n'}),
        P("report_out_is_a_file", "report", argv=("report", "r", "--out", "f"),
          files={"r/summary.json": '{"name": "r"}', "f": "x"}),
        # ---- hetrain launch
        P("launch_missing_config", "launch", argv=("launch", "none.toml")),
        P("launch_nproc_wrong", "launch", argv=("launch", "c.toml", "--nproc", "3")),
        P("launch_nproc_negative", "launch", argv=("launch", "c.toml", "--nproc", "-1")),
        P("launch_nnodes_zero", "launch", argv=("launch", "c.toml", "--nnodes", "0")),
        P("launch_nnodes_2_no_master", "launch", argv=("launch", "c.toml", "--nnodes", "2",
                                                       "--nproc-per-node", "3")),
        P("launch_master_no_port", "launch", argv=(
            "launch", "c.toml", "--nnodes", "2", "--nproc-per-node", "3,2",
            "--master", "127.0.0.1")),
        P("launch_master_port_text", "launch", argv=(
            "launch", "c.toml", "--nnodes", "2", "--nproc-per-node", "3,2",
            "--master", "127.0.0.1:http")),
        P("launch_nproc_per_node_garbage", "launch", argv=(
            "launch", "c.toml", "--nnodes", "2", "--nproc-per-node", "a,b",
            "--master", "127.0.0.1:29500")),
        P("launch_nproc_per_node_sum_wrong", "launch", argv=(
            "launch", "c.toml", "--nnodes", "2", "--nproc-per-node", "1,1",
            "--master", "127.0.0.1:29500")),
        P("launch_node_rank_out_of_range", "launch", argv=(
            "launch", "c.toml", "--nnodes", "2", "--nproc-per-node", "3,2", "--node-rank", "2",
            "--master", "127.0.0.1:29500")),
        P("launch_multi_flag_on_one_node", "launch", argv=("launch", "c.toml", "--node-rank",
                                                           "1")),
        P("launch_runs_dir_is_a_file", "launch", argv=("launch", "c.toml", "--runs-dir", "f"),
          files={"f": "x"}),
        P("launch_ps_shards_100", "launch", {"strategy": {"name": "asp"}},
          argv=("launch", "c.toml", "--set", "dist.ps_shards=100")),
        # ---- hetrain join
        P("join_missing_config", "join", argv=("join", "none.toml")),
        P("join_allreduce_strategy", "join", {"strategy": {"name": "ddp"}},
          argv=("join", "c.toml")),
        P("join_no_running_run", "join", argv=("join", "c.toml", "--runs-dir", "runs")),
        P("join_wait_negative", "join", argv=("join", "c.toml", "--wait", "-1")),
        P("join_wait_nan", "join", argv=("join", "c.toml", "--wait", "nan")),
        P("join_wait_inf", "join", argv=("join", "c.toml", "--wait", "inf",
                                         "--endpoint", "bad"), timeout=60),
        P("join_endpoint_garbage", "join", argv=("join", "c.toml", "--endpoint", "nohost")),
        P("join_endpoint_port_huge", "join", argv=("join", "c.toml", "--endpoint",
                                                   "127.0.0.1:999999")),
        P("join_endpoint_nobody_listens", "join", argv=(
            "join", "c.toml", "--endpoint", "127.0.0.1:9"), timeout=120),
        P("join_worker_negative", "join", argv=("join", "c.toml", "--worker", "-3",
                                                "--endpoint", "127.0.0.1:9"), timeout=120),
        P("join_join_json_garbage", "join", argv=("join", "c.toml"),
          files={"runs/tiny/join.json": _noise(200)}),
        P("join_join_json_wrong_types", "join", argv=("join", "c.toml"),
          files={"runs/tiny/join.json": json.dumps({"host": 5, "port": "x"})}),
    ]
    return out


# ---- running one probe ------------------------------------------------------------------------

def _write(path: Path, content: str | bytes | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if content is None:
        path.mkdir(exist_ok=True)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() or p.is_symlink()}


@contextmanager
def _held_port(addr: str) -> Iterator[int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((addr, 0))
    s.listen(1)
    try:
        yield int(s.getsockname()[1])
    finally:
        s.close()


def _diff(probe: Probe) -> str:
    if isinstance(probe.config, dict):
        if not probe.config:
            return ""
        return json.dumps(probe.config, default=lambda o: "<removed>" if o is DROP else str(o))
    if probe.config is None:
        return "(no c.toml)"
    raw = probe.config if isinstance(probe.config, bytes) else probe.config.encode()
    return f"c.toml = {len(raw)} bytes: {raw[:40]!r}{'...' if len(raw) > 40 else ''}"


def _non_blank(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def run_probe(probe: Probe, finished: Path, env: dict[str, str]) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"probe-{probe.name[:40]}-"))
    wd = tmp / "a" / "b"
    wd.mkdir(parents=True)
    try:
        if isinstance(probe.config, dict):
            _write(wd / "c.toml", tomli_w.dumps(_merge(BASE, probe.config)))
        elif probe.config is not None:
            _write(wd / "c.toml", probe.config)
        for name, content in probe.files.items():
            _write(wd / name, content)
        if probe.setup == "finished":
            shutil.copytree(finished, wd / "runs" / "tiny")
        if probe.edit is not None:
            probe.edit(wd)
        before = _snapshot(tmp)
        hold = probe.setup.removeprefix("hold:") if probe.setup.startswith("hold:") else ""
        with _held_port(hold) if hold else _no_port() as port:
            argv = [a.replace("{port}", str(port)) for a in (probe.argv or (*RUN, *probe.args))]
            started = time.monotonic()
            rc, stdout, stderr = _run([sys.executable, "-m", "hetrain", *argv], wd, env,
                                      probe.timeout)
            wall = time.monotonic() - started
        after = _snapshot(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    changed = sorted(set(after) ^ set(before) | {k for k in after if k in before
                                                    and after[k] != before[k]})
    lines = _non_blank(stderr)
    why: list[str] = []
    if rc != probe.expect:
        why.append(f"exit {rc}, expected {probe.expect}")
    if "Traceback" in stderr or "Traceback" in stdout:
        why.append("traceback")
    if probe.expect == 2:
        if len(lines) != 1:
            why.append(f"{len(lines)} stderr lines")
        if changed:
            why.append(f"wrote {changed[:4]}{'...' if len(changed) > 4 else ''}")
    return {"name": probe.name, "area": probe.area, "change": _diff(probe),
            "command": "hetrain " + shlex.join(argv), "setup": probe.setup, "note": probe.note,
            "expect": probe.expect, "exit": rc, "wall_s": round(wall, 1),
            "stderr_lines": len(lines), "first_line": lines[0][:300] if lines else "",
            "stderr_tail": "\n".join(lines[-6:])[-1500:] if why else "",
            "changed": changed[:20], "clean": not why, "why": "; ".join(why)}


@contextmanager
def _no_port() -> Iterator[int]:
    yield 0


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run in its own process group; on timeout kill the whole group (its spawned ranks too)."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, errors="replace", start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return 124, out, err + f"\n(probe harness: timed out after {timeout:.0f} s, killed)"


def finished_run(root: Path, env: dict[str, str]) -> Path:
    """A finished run of BASE (its checkpoint is what the resume probes damage)."""
    wd = root / "finished"
    wd.mkdir(parents=True)
    (wd / "c.toml").write_text(tomli_w.dumps(BASE))
    rc, _, err = _run([sys.executable, "-m", "hetrain", *RUN, "--quiet", "--no-plot"], wd, env,
                      300)
    if rc != 0:
        sys.exit(f"the base config does not run (exit {rc}):\n{err}")
    return wd / "runs" / "tiny"


# ---- report -----------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_report(rows: list[dict[str, Any]], command: str, wall_s: float, stem: str) -> None:
    clean = sum(r["clean"] for r in rows)
    OUT.mkdir(exist_ok=True)
    (OUT / f"{stem}.json").write_text(json.dumps(
        {"command": command, "tried": len(rows), "clean": clean, "wall_s": round(wall_s),
         "python": sys.version.split()[0], "probes": rows}, indent=1) + "\n")
    areas = sorted({r["area"] for r in rows}, key=[r["area"] for r in rows].index)
    lines = [
        "# Bad-input and quick-fault probes (issue 14)", "",
        f"Command: `{command}` ({wall_s / 60:.1f} min). Harness: "
        "[benchmarks/probe_inputs.py](../probe_inputs.py).", "",
        f"**Probes tried / handled cleanly: {len(rows)} / {clean}**", "",
        "Handled cleanly, for a probe that expects an error (exit 2): exit code 2, exactly one "
        "non-blank stderr line (no warning filtered out), no `Traceback`, and no file added, "
        "removed or changed under the probe's temporary directory. For a probe that expects "
        "the command to work (expect 0): exit 0, no traceback, within its timeout. Every probe "
        "is a subprocess `python -m hetrain ...` in a fresh directory; `run` probes use "
        "`hetrain run c.toml --runs-dir runs` with c.toml = the base config below plus the "
        "probe's change. Resume probes start from a copy of a finished run of the base config.",
        "", f"Base config: `{json.dumps(BASE)}`", "",
        "| area | tried | clean |", "|---|---|---|",
        *(f"| {a} | {sum(r['area'] == a for r in rows)} | "
          f"{sum(r['clean'] for r in rows if r['area'] == a)} |" for a in areas), "",
    ]
    bad = [r for r in rows if not r["clean"]]
    if bad:
        lines += ["## Not handled cleanly", "",
                  "| probe | command | why | stderr (last lines) |", "|---|---|---|---|",
                  *(f"| {r['name']} | `{_cell(r['command'])}` | {_cell(r['why'])} | "
                    f"{_cell(r['stderr_tail'][-400:])} |" for r in bad), ""]
    lines += ["## Every probe", "",
              "| probe | change to the base config | command | expect | exit | first stderr "
              "line | verdict |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        change = _cell(r["change"][:160] + (f" ({r['note']})" if r["note"] else ""))
        verdict = "clean" if r["clean"] else f"NOT: {_cell(r['why'])}"
        lines.append(f"| {r['name']} | {change} | `{_cell(r['command'])}` | {r['expect']} | "
                     f"{r['exit']} | {_cell(r['first_line'][:200])} | {verdict} |")
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2, help="probes run at once")
    ap.add_argument("--only", default="", help="run only probes whose name contains this")
    ap.add_argument("--out", default="probe_inputs", help="results file stem")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("HETRAIN_SECRET", None)
    env.pop("HETRAIN_SECRET_FILE", None)
    todo = [p for p in probes() if args.only in p.name]
    assert len({p.name for p in todo}) == len(todo), "probe names must be unique"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="probe-base-") as base:
        finished = finished_run(Path(base), env)
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = []
            for row in pool.map(lambda p: run_probe(p, finished, env), todo):
                rows.append(row)
                mark = "ok " if row["clean"] else "BAD"
                print(f"{mark} {row['name']:<40} exit {row['exit']:>3} {row['wall_s']:>6.1f}s "
                      f"{row['why'] or row['first_line'][:70]}", flush=True)
    wall = time.monotonic() - started
    cmd = "PYTHONPATH=src .venv/bin/python benchmarks/probe_inputs.py" + \
        (f" --only {args.only}" if args.only else "") + \
        (f" --jobs {args.jobs}" if args.jobs != 2 else "")
    write_report(rows, cmd, wall, args.out)
    clean = sum(r["clean"] for r in rows)
    print(f"probes tried / handled cleanly: {len(rows)} / {clean} ({wall / 60:.1f} min)")


if __name__ == "__main__":
    main()
