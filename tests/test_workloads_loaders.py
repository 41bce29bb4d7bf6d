"""Workloads data sets: digits, mnist1d, text, imagefolder and cifar10 (files made in tmp_path)."""

from __future__ import annotations

import re
import sysconfig

import numpy as np
import pytest
import torch
from PIL import Image

from hetrain.workloads import DATASETS, gather, get_workload, sample_bytes_of
from hetrain.workloads.datasets import _mnist1d_arrays
from hetrain.workloads.images import CIFAR_MEAN, CIFAR_STD, IMAGENET_MEAN, IMAGENET_STD
from hetrain.workloads.text import decode


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _check_split(ds, meta, n_check: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = gather(ds, torch.arange(min(n_check, len(ds))))
    assert tuple(x.shape[1:]) == meta["input_shape"]
    assert y.dtype == torch.long and int(y.min()) >= 0 and int(y.max()) < meta["num_classes"]
    assert sample_bytes_of(x[0], y[0]) == meta["sample_bytes"]
    return x, y


def test_digits():
    train, test, meta = DATASETS["digits"]()
    assert (len(train), len(test)) == (1438, 359) and meta["task"] == "classification"
    x, y = _check_split(train, meta, len(train))
    assert x.dtype == torch.float32 and set(y.tolist()) == set(range(10))
    assert abs(float(x.mean())) < 1e-4 and float(x.std()) == pytest.approx(1.0, abs=1e-3)
    again, other = DATASETS["digits"]()[0], DATASETS["digits"](seed=1)[0]
    assert torch.equal(again.tensors[0], train.tensors[0])
    assert not torch.equal(other.tensors[1], train.tensors[1])


def test_mnist1d_generation_deterministic_and_rng_neutral(tmp_path):
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    train, test, meta = DATASETS["mnist1d"](num_samples=2000)
    assert np.array_equal(before, np.random.get_state()[1])
    assert (len(train), len(test)) == (1600, 400) and meta["input_shape"] == (1, 40)
    x, y = _check_split(train, meta, len(train))
    assert x.dtype == torch.float32 and set(y.tolist()) == set(range(10))
    _mnist1d_arrays.cache_clear()
    fresh = DATASETS["mnist1d"](num_samples=2000, cache_dir=tmp_path)[0]
    assert torch.equal(fresh.tensors[0], train.tensors[0])
    assert (tmp_path / "mnist1d_n2000_s42.npz").exists()
    _mnist1d_arrays.cache_clear()
    cached = DATASETS["mnist1d"](num_samples=2000, cache_dir=tmp_path)[0]
    assert torch.equal(cached.tensors[0], train.tensors[0])
    other = DATASETS["mnist1d"](num_samples=2000, seed=7)[0]
    assert not torch.equal(other.tensors[0], train.tensors[0])


def _write_corpus(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("hello world\n" * 30)
    (root / "sub" / "b.py").write_text("print('héllo')\n" * 30)
    (root / "notes.md").write_text("IGNORED" * 100)
    return (root / "a.txt").read_text() + (root / "sub" / "b.py").read_text()


def test_text_corpus_from_files(tmp_path):
    text = _write_corpus(tmp_path)
    train, test, meta = DATASETS["text"](paths=tmp_path, block_size=16)
    assert meta["task"] == "language_model" and meta["vocab"] == "".join(sorted(set(text)))
    assert meta["num_classes"] == len(meta["vocab"]) and meta["input_shape"] == (16,)
    x, y = _check_split(train, meta, len(train))
    assert torch.equal(x[:, 1:], y[:, :-1])
    n_test = int(len(text) * 0.1)
    assert len(train) == (len(text) - n_test - 1 - 16) // 16 + 1
    assert decode(torch.cat(list(x)), meta["vocab"]) == text[: 16 * len(train)]
    tx, _ = gather(test, torch.arange(len(test)))
    assert decode(tx[0], meta["vocab"]) == text[len(text) - n_test :][:16]
    xi, yi = train[3]
    assert torch.equal(xi, x[3]) and torch.equal(yi, y[3])
    with pytest.raises(IndexError):
        train[len(train)]


def test_text_options(tmp_path):
    text = _write_corpus(tmp_path)
    strided = DATASETS["text"](paths=[tmp_path / "a.txt"], block_size=8, stride=4)[0]
    x, _ = gather(strided, torch.tensor([0, 1]))
    assert torch.equal(x[0, 4:], x[1, :4])
    train, _, meta = DATASETS["text"](paths=str(tmp_path), vocab="bytes", block_size=16)
    assert meta["num_classes"] == 256 and meta["vocab"] is None
    x, _ = gather(train, torch.arange(len(train)))
    assert bytes(torch.cat(list(x)).tolist()) == text.encode()[: 16 * len(train)]
    capped = DATASETS["text"](paths=tmp_path, max_chars=200, block_size=8)
    assert len(capped[0]) + len(capped[1]) < 200 // 8
    with pytest.raises(ValueError, match="does not exist"):
        DATASETS["text"](paths=tmp_path / "missing")
    with pytest.raises(ValueError, match="tokens"):
        DATASETS["text"](paths=tmp_path, max_chars=100, block_size=64)
    with pytest.raises(ValueError, match="unknown vocab"):
        DATASETS["text"](paths=tmp_path, vocab="words")


def test_text_default_is_the_stdlib():
    train, _, meta = DATASETS["text"](max_chars=30_000, block_size=32)
    assert meta["files"][0].startswith(sysconfig.get_paths()["stdlib"])
    assert all(f.endswith((".py", ".txt")) for f in meta["files"])
    assert meta["num_classes"] > 40 and len(train) == (27_000 - 1 - 32) // 32 + 1
    _check_split(train, meta)


COLORS = {"cat": (255, 0, 0), "dog": (0, 0, 255)}


def _write_images(root, n: int = 3, classes=COLORS):
    for name, color in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (10 + i, 8), color).save(root / name / f"{i}.png")
    if "cat" in classes:
        Image.new("L", (9, 9), 255).save(root / "cat" / "gray.jpg")  # grayscale JPEG -> RGB


def _expected(color, mean, std) -> torch.Tensor:
    return torch.tensor([(c / 255 - m) / s for c, m, s in zip(color, mean, std, strict=True)])


def test_imagefolder_flat_tree(tmp_path):
    _write_images(tmp_path)
    train, test, meta = DATASETS["imagefolder"](root=tmp_path, size=16, test_fraction=0.25)
    assert meta["classes"] == ["cat", "dog"] and meta["input_shape"] == (3, 16, 16)
    assert (len(train), len(test)) == (5, 2)
    x, _ = _check_split(train, meta, len(train))
    for (path, label), xi in zip(train.samples, x, strict=True):
        color = (255, 255, 255) if path.endswith("gray.jpg") else COLORS[meta["classes"][label]]
        expect = _expected(color, IMAGENET_MEAN, IMAGENET_STD)
        torch.testing.assert_close(xi[:, 5, 5], expect, atol=0.05, rtol=0)
    again = DATASETS["imagefolder"](root=tmp_path, size=16, test_fraction=0.25)[1]
    assert again.samples == test.samples


def test_imagefolder_imagenet_layout_and_get_workload(tmp_path):
    _write_images(tmp_path / "train")
    _write_images(tmp_path / "val", n=1)
    w = get_workload("cnn", "imagefolder", dataset_options={"root": tmp_path, "size": 12})
    assert (len(w.train), len(w.test), w.num_classes) == (7, 3, 2)
    assert all("/val/" in p for p, _ in w.test.samples)
    x, y = gather(w.test, torch.arange(3))
    assert w.build_model()(x).shape == (3, 2) and y.tolist() == [0, 0, 1]


def test_imagefolder_errors(tmp_path):
    with pytest.raises(ValueError, match=r"missing.*does not exist.*root/<class>/<image>"):
        DATASETS["imagefolder"](root=tmp_path / "missing")
    with pytest.raises(ValueError, match=rf"no images .*'{re.escape(str(tmp_path))}'"):
        DATASETS["imagefolder"](root=tmp_path)
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "readme.txt").write_text("not an image")
    with pytest.raises(ValueError, match="no images"):
        DATASETS["imagefolder"](root=tmp_path)
    _write_images(tmp_path / "in" / "train")
    with pytest.raises(ValueError, match="no val/ or test/"):
        DATASETS["imagefolder"](root=tmp_path / "in")
    _write_images(tmp_path / "in" / "val", classes={"cow": (0, 0, 0)})
    with pytest.raises(ValueError, match=r"classes not in the train split: \['cow'\]"):
        DATASETS["imagefolder"](root=tmp_path / "in")


def _write_cifar(root, sizes=(3, 3, 3, 3, 3, 2), seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    records = {}
    for name, n in zip(names, sizes, strict=True):
        rec = rng.integers(0, 256, size=(n, 3073), dtype=np.uint8)
        rec[:, 0] = rng.integers(0, 10, size=n)
        rec.tofile(root / name)
        records[name] = rec
    return records


def test_cifar10_parses_what_was_written(tmp_path):
    rec = _write_cifar(tmp_path / "cifar-10-batches-bin")
    train, test, meta = DATASETS["cifar10"](root=tmp_path)
    assert (len(train), len(test)) == (15, 2) and meta["classes"][0] == "airplane"
    tr = np.concatenate([rec[f"data_batch_{i}.bin"] for i in range(1, 6)])
    assert train.labels.tolist() == tr[:, 0].tolist()
    assert test.labels.tolist() == rec["test_batch.bin"][:, 0].tolist()
    r = tr[4]  # channel-major: pixel (c, h, w) is byte 1 + c*1024 + h*32 + w
    assert int(train.images[4, 2, 5, 7]) == int(r[1 + 2 * 1024 + 5 * 32 + 7])
    assert np.array_equal(train.images[4].numpy().reshape(-1), r[1:])
    x, _ = _check_split(train, meta, len(train))
    std, mean = torch.tensor(CIFAR_STD).view(3, 1, 1), torch.tensor(CIFAR_MEAN).view(3, 1, 1)
    torch.testing.assert_close((x * std + mean) * 255, train.images.float(), atol=1e-3, rtol=0)
    xi, yi = train[4]
    assert torch.equal(xi, x[4]) and int(yi) == int(r[0])
    assert len(DATASETS["cifar10"](root=tmp_path, max_train=4)[0]) == 4
    w = get_workload("resnet", "cifar10", dataset_options={"root": tmp_path})
    assert w.build_model()(x[:2]).shape == (2, 10) and w.sample_bytes == 3072 * 4 + 8


def test_cifar10_errors(tmp_path):
    with pytest.raises(ValueError, match=r"cifar10: root '.*missing' does not exist"):
        DATASETS["cifar10"](root=tmp_path / "missing")
    _write_cifar(tmp_path)
    (tmp_path / "data_batch_3.bin").unlink()
    with pytest.raises(ValueError, match=r"missing \['data_batch_3.bin'\]"):
        DATASETS["cifar10"](root=tmp_path)
    (tmp_path / "data_batch_3.bin").write_bytes(b"\x01" * (3073 * 2 - 5))
    with pytest.raises(ValueError, match=r"data_batch_3.bin' has 6141 bytes.*truncated"):
        DATASETS["cifar10"](root=tmp_path)
    (tmp_path / "data_batch_3.bin").write_bytes(b"\x0c" * 3073)
    with pytest.raises(ValueError, match="label 12"):
        DATASETS["cifar10"](root=tmp_path)
