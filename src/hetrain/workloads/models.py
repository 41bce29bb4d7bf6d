"""Small classifiers (mlp, cnn, vgg, resnet), sized to train on a couple of CPU cores.

Every builder is `(input_shape, num_classes, **options) -> nn.Module`, consumes only the global
torch RNG (so `torch.manual_seed` makes it deterministic) and accepts a batch shaped
(B, *input_shape). Conv nets expose `features` and `classifier` (or `fc`) so that pipeline
planners can cut them at stage boundaries.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetrain.errors import ConfigError
from hetrain.workloads.registry import register_model


def _signal_shape(input_shape: tuple[int, ...]) -> tuple[int, ...]:
    """(L,) -> (1, L); (C, L) and (C, H, W) unchanged."""
    if len(input_shape) == 1:
        return (1, *input_shape)
    if len(input_shape) in (2, 3):
        return tuple(input_shape)
    raise ConfigError(f"expected an input of shape (L,), (C, L) or (C, H, W), got {input_shape}")


@torch.no_grad()
def _out_numel(module: nn.Module, shape: tuple[int, ...]) -> int:
    """Flattened output size of `module` on one sample (a dry run, draws no random numbers)."""
    was = module.training
    out = module.eval()(torch.zeros(1, *shape)).numel()
    module.train(was)
    return out


class ConvNet(nn.Module):
    """features -> flatten -> classifier, reshaping flat inputs to `in_shape` first."""

    def __init__(self, in_shape: tuple[int, ...], features: nn.Module, classifier: nn.Module):
        super().__init__()
        self.in_shape, self.features, self.classifier = in_shape, features, classifier

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x.reshape(x.shape[0], *self.in_shape)).flatten(1))


@register_model("mlp", inputs=("signal", "image"))
def mlp(
    input_shape: tuple[int, ...], num_classes: int, *, hidden: Sequence[int] = (128, 128)
) -> nn.Module:
    """Flatten -> [Linear -> ReLU] per hidden size -> Linear."""
    dims = [math.prod(input_shape), *hidden]
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in itertools.pairwise(dims):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(dims[-1], num_classes))


@register_model("cnn", inputs=("signal", "image"))
def cnn(
    input_shape: tuple[int, ...], num_classes: int, *, channels: int = 32, layers: int = 3
) -> nn.Module:
    """`layers` conv+ReLU (all but the first with stride 2), flatten, one Linear.

    Conv1d with kernel 5 for 1-D signals such as MNIST-1D's (1, 40) (~14k params by default),
    Conv2d with kernel 3 for (C, H, W) images. Flattening (no global pooling) keeps the position
    information MNIST-1D needs.
    """
    shape = _signal_shape(input_shape)
    conv, k = (nn.Conv1d, 5) if len(shape) == 2 else (nn.Conv2d, 3)
    mods: list[nn.Module] = []
    c = shape[0]
    for i in range(layers):
        mods += [conv(c, channels, k, stride=1 if i == 0 else 2, padding=k // 2), nn.ReLU()]
        c = channels
    features = nn.Sequential(*mods)
    return ConvNet(shape, features, nn.Linear(_out_numel(features, shape), num_classes))


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(f"model '{name}' needs image inputs (C, H, W), got shape {input_shape}")
    c, h, w = input_shape
    return c, h, w


@register_model("vgg", inputs=("image",))
def vgg(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    width: int = 16,
    convs: Sequence[int] = (1, 1, 2),
    fc: int = 128,
    batch_norm: bool = False,
) -> nn.Module:
    """VGG-style: stage i = convs[i] x (conv3x3 -> ReLU) at width * 2**i, then 2x2 max-pool.

    Pooling stops at 1 px (so 8x8 digits and 32x32 CIFAR both work) and an adaptive average pool
    caps the map at 4x4 before the Linear -> ReLU -> Linear classifier.
    """
    c, h, w = _image_shape("vgg", input_shape)
    mods: list[nn.Module] = []
    for i, n in enumerate(convs):
        out = width * 2**i
        for _ in range(n):
            mods += [nn.Conv2d(c, out, 3, padding=1)]
            mods += [nn.BatchNorm2d(out), nn.ReLU()] if batch_norm else [nn.ReLU()]
            c = out
        if min(h, w) >= 2:
            mods.append(nn.MaxPool2d(2))
            h, w = h // 2, w // 2
    mods.append(nn.AdaptiveAvgPool2d((min(h, 4), min(w, 4))))
    features, shape = nn.Sequential(*mods), tuple(input_shape)
    classifier = nn.Sequential(
        nn.Linear(_out_numel(features, shape), fc), nn.ReLU(), nn.Linear(fc, num_classes)
    )
    return ConvNet(shape, features, classifier)


def _norm(kind: str, ch: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(ch)
    if kind == "group":
        return nn.GroupNorm(math.gcd(8, ch), ch)
    if kind == "none":
        return nn.Identity()
    raise ConfigError(f"unknown norm '{kind}'; choose one of: batch, group, none")


class BasicBlock(nn.Module):
    """conv3x3 -> norm -> ReLU -> conv3x3 -> norm, plus a (projected) shortcut, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str):
        super().__init__()
        bias = norm == "none"
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=bias)
        self.bn1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=bias)
        self.bn2 = _norm(norm, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=bias), _norm(norm, cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """stem -> layers (stages of BasicBlocks) -> global average pool -> fc."""

    def __init__(
        self, input_shape: tuple[int, int, int], num_classes: int, width: int,
        blocks: Sequence[int], norm: str,
    ):
        super().__init__()
        c, h, w = input_shape
        stem_stride = 2 if min(h, w) >= 64 else 1  # downsample early on big images, like ImageNet
        self.stem = nn.Sequential(
            nn.Conv2d(c, width, 3, stem_stride, 1, bias=norm == "none"), _norm(norm, width), nn.ReLU()
        )
        stages: list[nn.Module] = []
        cin = width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            stages.append(nn.Sequential(*[
                BasicBlock(cin if j == 0 else cout, cout, 2 if (i > 0 and j == 0) else 1, norm)
                for j in range(n)
            ]))
            cin = cout
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))


@register_model("resnet", inputs=("image",))
def resnet(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    width: int = 16,
    blocks: Sequence[int] = (1, 1, 1),
    norm: str = "batch",
) -> nn.Module:
    """ResNet-style basic blocks (ResNet-8 by default, ~78k params); stage i has width * 2**i
    channels and halves the resolution for i > 0. norm: "batch", "group" (no running stats,
    independent of the per-device batch size) or "none"."""
    _norm(norm, width)  # validate early
    return ResNet(_image_shape("resnet", input_shape), num_classes, width, blocks, norm)
