"""Workloads: models, batching, evaluation, get_workload and flops_per_sample."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from hetrain.workloads import (
    DATASETS,
    MODELS,
    Batcher,
    Workload,
    correct_count,
    cross_entropy,
    evaluate,
    flops_per_sample,
    gather,
    get_workload,
    num_params,
)

SMALL = {"mnist1d": {"num_samples": 2000}, "text": {"max_chars": 40_000, "block_size": 32}}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def wl():
    cache: dict[tuple[str, str], Workload] = {}

    def get(model: str, dataset: str, **model_options) -> Workload:
        key = (model, dataset, repr(sorted(model_options.items())))
        if key not in cache:
            cache[key] = get_workload(model, dataset, model_options, SMALL.get(dataset))
        return cache[key]

    return get


def test_registries():
    assert set(MODELS) == {"mlp", "cnn", "vgg", "resnet", "gpt"}
    assert set(DATASETS) == {"digits", "mnist1d", "text", "imagefolder", "cifar10"}


def _fit(model: nn.Module, loss_fn, x, y, steps: int, lr: float) -> tuple[float, float]:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    with torch.no_grad():
        first = float(loss_fn(model(x), y))
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        return first, float(loss_fn(model(x), y))


PAIRS = [("mlp", "mnist1d"), ("cnn", "mnist1d"), ("mlp", "digits"), ("cnn", "digits"),
         ("vgg", "digits"), ("resnet", "digits"), ("gpt", "text")]


@pytest.mark.parametrize(("model", "dataset"), PAIRS)
def test_model_output_shape_and_training_lowers_loss(wl, model, dataset):
    w = wl(model, dataset)
    assert w.name == f"{dataset}-{model}"
    torch.manual_seed(0)
    net = w.build_model()
    n = 8 if w.task == "language_model" else 64
    x, y = gather(w.train, torch.arange(n))
    out = net(x)
    expect = (n, *w.input_shape, w.num_classes) if w.task == "language_model" else (n, w.num_classes)
    assert out.shape == expect
    first, last = _fit(net, w.loss_fn, x, y, steps=30, lr=3e-3)
    assert last < 0.7 * first, (first, last)


@pytest.mark.parametrize("model", ["cnn", "vgg", "resnet", "mlp"])
@pytest.mark.parametrize("shape", [(3, 32, 32), (3, 64, 64)])
def test_image_models_on_cifar_and_imagenet_sizes(model, shape):
    torch.manual_seed(0)
    net = MODELS[model](shape, 7)
    x, y = torch.randn(4, *shape), torch.arange(4) % 7
    assert net(x).shape == (4, 7)
    if shape[1] == 32:
        first, last = _fit(net, cross_entropy, x, y, steps=15, lr=3e-3)
        assert last < 0.7 * first, (first, last)


def test_models_are_small_by_default(wl):
    assert 10_000 <= num_params(wl("cnn", "mnist1d").build_model()) <= 50_000
    assert num_params(wl("gpt", "text").build_model()) < 200_000


def test_cnn_accepts_flat_1d_inputs():
    net = MODELS["cnn"]((40,), 10)
    assert net(torch.randn(3, 40)).shape == (3, 10)


@pytest.mark.parametrize(("model", "dataset"), [("resnet", "digits"), ("gpt", "text")])
def test_build_model_is_deterministic_under_manual_seed(wl, model, dataset):
    w = wl(model, dataset)
    torch.manual_seed(3)
    a = w.build_model().state_dict()
    torch.manual_seed(3)
    b = w.build_model().state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gpt_submodule_names_for_tensor_parallel_plans():
    net = MODELS["gpt"]((16,), 50, n_layer=2, n_head=4, n_embd=32)
    mods = dict(net.named_modules())
    for i in range(2):
        for name in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj"):
            assert isinstance(mods[f"blocks.{i}.{name}"], nn.Linear)
    assert isinstance(mods["tok_emb"], nn.Embedding) and isinstance(mods["head"], nn.Linear)
    assert mods["head"].weight is not mods["tok_emb"].weight  # untied by default
    tied = MODELS["gpt"]((16,), 50, tie_weights=True)
    assert tied.head.weight is tied.tok_emb.weight


def test_gpt_attention_splits_by_heads_like_colwise_rowwise_tp():
    torch.manual_seed(0)
    attn = MODELS["gpt"]((8,), 20, n_head=4, n_embd=32).blocks[0].attn
    x = torch.randn(2, 8, 32)
    full, parts = attn(x), []
    for sl in (slice(0, 16), slice(16, 32)):  # two ranks, two heads each
        shard = copy.deepcopy(attn)
        for name in ("q", "k", "v"):
            lin, new = getattr(attn, name), nn.Linear(32, 16)
            new.weight.data, new.bias.data = lin.weight[sl].clone(), lin.bias[sl].clone()
            setattr(shard, name, new)
        shard.proj = nn.Linear(16, 32)
        shard.proj.weight.data, shard.proj.bias.data = attn.proj.weight[:, sl].clone(), torch.zeros(32)
        parts.append(shard(x))
    torch.testing.assert_close(parts[0] + parts[1] + attn.proj.bias, full, atol=1e-5, rtol=1e-4)


def test_gpt_is_causal_and_checks_length():
    torch.manual_seed(0)
    net = MODELS["gpt"]((16,), 30).eval()
    a = torch.randint(0, 30, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 30
    torch.testing.assert_close(net(a)[:, :10], net(b)[:, :10])
    assert not torch.allclose(net(a)[:, 10:], net(b)[:, 10:])
    with pytest.raises(ValueError, match="block_size"):
        net(torch.zeros(1, 17, dtype=torch.long))


def test_correct_count_and_loss_for_both_tasks():
    out = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]])
    assert correct_count(out, torch.tensor([0, 1, 1])) == (2, 3)
    lm = torch.zeros(2, 3, 5)
    lm[..., 4] = 1.0
    tgt = torch.tensor([[4, 4, 0], [1, 4, 4]])
    assert correct_count(lm, tgt) == (4, 6)
    torch.testing.assert_close(cross_entropy(lm, tgt),
                               nn.functional.cross_entropy(lm.reshape(6, 5), tgt.reshape(6)))


class _Items(Dataset):
    """A plain map-style dataset (no fast path)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def test_gather_fast_and_generic_paths_agree():
    x, y = torch.randn(20, 3, 4), torch.arange(20)
    idx = torch.tensor([5, 0, 19, 5])
    for ds in (TensorDataset(x, y), _Items(x, y)):
        gx, gy = gather(ds, idx)
        assert torch.equal(gx, x[idx]) and torch.equal(gy, y[idx]) and gy.dtype == torch.long
    sub = Subset(TensorDataset(x, y), [3, 7, 11])
    gx, gy = gather(sub, [2, 0])
    assert gy.tolist() == [11, 3] and torch.equal(gx, x[[11, 3]])


def test_batcher_epochs_are_deterministic_permutations():
    ds = TensorDataset(torch.arange(10).float(), torch.arange(10))
    b = Batcher(ds, 3, seed=1)
    e0, e1 = [y for _, y in b], [y for _, y in b]
    assert len(b) == 4 and [len(t) for t in e0] == [3, 3, 3, 1]
    assert sorted(torch.cat(e0).tolist()) == list(range(10))
    assert torch.cat(e0).tolist() != torch.cat(e1).tolist()
    assert torch.cat(e0).tolist() == torch.cat([y for _, y in Batcher(ds, 3, seed=1)]).tolist()
    shard = Batcher(ds, 2, indices=[1, 3, 5], drop_last=True, shuffle=False)
    assert [y.tolist() for _, y in shard] == [[1, 3]]


def test_evaluate_restores_mode_and_ignores_batch_size(wl):
    w = wl("cnn", "digits")
    torch.manual_seed(0)
    net = w.build_model()
    loss, acc = evaluate(net, w.test, w.loss_fn, batch_size=100)
    assert net.training
    x, y = gather(w.test, torch.arange(len(w.test)))
    with torch.no_grad():
        out = net(x)
    assert acc == pytest.approx(correct_count(out, y)[0] / len(y))
    assert loss == pytest.approx(float(w.loss_fn(out, y)), rel=1e-5)
    net.eval()
    assert evaluate(net, w.test, w.loss_fn, batch_size=7) == pytest.approx((loss, acc), rel=1e-5)
    assert not net.training


def test_evaluate_language_model_counts_tokens(wl):
    w = wl("gpt", "text")
    net = w.build_model()
    loss, acc = evaluate(net, w.test, w.loss_fn, batch_size=64)
    assert 0.0 <= acc <= 1.0 and loss == pytest.approx(math.log(w.num_classes), rel=0.2)


def test_get_workload_errors_name_the_bad_value_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown model 'x'; choose one of: cnn, gpt, mlp"):
        get_workload("x", "digits")
    with pytest.raises(ValueError, match=r"unknown dataset 'nope'; choose one of: cifar10, digits"):
        get_workload("mlp", "nope")
    with pytest.raises(ValueError, match=r"'widht'.*choose from: .*width"):
        get_workload("vgg", "digits", {"widht": 8})
    with pytest.raises(ValueError, match=r"needs option.*root"):
        get_workload("resnet", "cifar10")
    with pytest.raises(ValueError, match="model 'gpt' needs dataset 'text'"):
        get_workload("gpt", "digits")
    with pytest.raises(ValueError, match="dataset 'text' needs model 'gpt'"):
        get_workload("mlp", "text")
    with pytest.raises(ValueError, match=r"'vgg' takes image inputs.*'mnist1d' gives signal"):
        get_workload("vgg", "mnist1d", dataset_options=SMALL["mnist1d"])
    with pytest.raises(ValueError, match="divisible"):
        get_workload("gpt", "text", {"n_embd": 30, "n_head": 4}, SMALL["text"])
    with pytest.raises(ValueError, match="unknown norm 'layer'"):
        get_workload("resnet", "digits", {"norm": "layer"})


def test_get_workload_leaves_the_global_rng_alone(wl):
    state = torch.get_rng_state()
    w = get_workload("resnet", "digits")
    flops_per_sample(w)
    assert torch.equal(state, torch.get_rng_state())


def test_workload_pickles_for_spawned_workers(wl):
    w = pickle.loads(pickle.dumps(wl("cnn", "digits")))
    x, y = gather(w.train, torch.arange(4))
    assert w.loss_fn(w.build_model()(x), y).ndim == 0


def test_flops_per_sample_positive_growing_and_cached(wl):
    small, big = wl("cnn", "mnist1d"), wl("cnn", "mnist1d", channels=64)
    assert 0 < flops_per_sample(small) < flops_per_sample(big)
    assert flops_per_sample(small) == flops_per_sample(small)
    g2, g4 = wl("gpt", "text"), wl("gpt", "text", n_layer=4)
    assert 0 < flops_per_sample(g2) < flops_per_sample(g4)
    # an MLP: forward is 2 * weights per sample, backward adds one or two matmuls per layer
    m = wl("mlp", "mnist1d")
    fwd = 2 * (40 * 128 + 128 * 128 + 128 * 10)
    assert 2 * fwd <= flops_per_sample(m) <= 3 * fwd


def test_gpt_flops_include_the_cpu_attention_kernel(wl):
    w = wl("gpt", "text")
    x, y = gather(w.train, torch.arange(2))
    with FlopCounterMode(display=False) as plain:
        w.loss_fn(w.build_model()(x), y).backward()
    assert flops_per_sample(w) > plain.get_total_flops() / 2 > 0


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x[:, :3] * self.w


def test_flops_per_sample_falls_back_to_six_times_params():
    ds = TensorDataset(torch.randn(4, 5), torch.zeros(4, dtype=torch.long))
    w = Workload(name="elementwise-test", train=ds, test=ds, build_model=_Scale,
                 loss_fn=cross_entropy, task="classification", num_classes=3, sample_bytes=28,
                 input_shape=(5,))
    assert flops_per_sample(w) == 6 * 3
