"""The same `hetrain.train` call on real processes: spawned by hetrain, and under torchrun.

Slow (each run starts 3 Python processes with torch on a shared 2-core box: ~20 s), so kept
out of the default run: `pytest -m slow tests/test_api_dist.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.timeout(240)]

TESTS = Path(__file__).resolve().parent
PAIR = {"name": "pair", "sites": [{"name": "s", "lan": {"bandwidth_Bps": 1e9},
                                   "wan": {"bandwidth_Bps": 1e9}}],
        "devices": [{"name": "slow", "flops": 1e9}, {"name": "fast", "flops": 2e9}]}
SCRIPT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(TESTS)!r})
    import hetrain
    from test_api import Blobs, Tiny

    if __name__ == "__main__":
        r = hetrain.train(Tiny(), Blobs(600), test_dataset=Blobs(200, 1), cluster={PAIR!r},
                          strategy="local_sgd", engine="dist", batch_size=16, max_epochs=1.0,
                          optimizer={{"name": "sgd", "lr": 0.1}},
                          config={{"dist": {{"emulate": "none"}}}})
        if r.summary.get("role") != "worker":
            print("RESULT", r.summary["engine"], r.final_accuracy, type(r.model).__name__)
""")


def test_train_on_spawned_processes():
    import hetrain
    from test_api import Blobs, Tiny

    test = Blobs(200, 1)
    r = hetrain.train(Tiny(), Blobs(600), test_dataset=test, cluster=PAIR, strategy="local_sgd",
                      engine="dist", batch_size=16, max_epochs=1.0,
                      optimizer={"name": "sgd", "lr": 0.1}, config={"dist": {"emulate": "none"}})
    assert r.summary["engine"] == "dist" and r.summary["n_workers"] == 2
    assert r.final_accuracy > 0.9 and isinstance(r.model, Tiny)
    with torch.no_grad():  # the model read back from the checkpoint is the evaluated one
        acc = float((r.model(test.x).argmax(1) == test.y).float().mean())
    assert acc == pytest.approx(r.final_accuracy, abs=1e-6)


def test_same_script_under_torchrun(tmp_path):
    script = tmp_path / "train_me.py"
    script.write_text(SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "3", str(script)],
                       capture_output=True, text=True, timeout=200, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
    engine, acc, model = line.split()[1:]
    assert engine == "dist" and float(acc) > 0.9 and model == "Tiny"
