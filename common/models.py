"""The networks of the numbered scripts. Each takes uint8 images [N, 3, H, W] and normalises them itself.

* `resnet18` (default): the CIFAR-10 variant of ResNet-18 (3x3 stem, no max-pool) from
  kuangliu/pytorch-cifar, which reports 93.02% test accuracy on CIFAR-10 with SGD and a cosine
  schedule (see the README for the recipe and our own measurements). 11.2 M parameters.
* `cnn`: a small 3-layer network (0.09 M parameters) for CPU smoke runs and tests. It uses
  GroupNorm, which normalises each image on its own: a batch split across processes gives
  exactly the gradient of the whole batch (batch norm would not, unless synchronised).

Both take num_classes and the data's per-channel mean and std (0-1 scale) as keywords, as a
torchvision constructor takes num_classes: `resnet18(num_classes=10, mean=..., std=...)`.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .cli import UserError


class Normalize(nn.Module):
    """uint8 images [0, 255] in, float out: (x - mean) / std per channel, in the dtype of the model (fp32, or bf16
    under DeepSpeed). A float input (already scaled or normalised by a transform) is refused in one line: it would
    be divided by 255 a second time without a word."""

    def __init__(self, mean, std):
        super().__init__()
        # Not persistent: the constants are code, not weights, so checkpoints hold only what was learnt.
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1) * 255, persistent=False)

    def forward(self, x):
        if x.dtype != torch.uint8:
            raise UserError(f"the model normalises uint8 images itself but got {x.dtype} ones: give it the images "
                            "as uint8 (0-255), or a model without models.Normalize")
        return (x.to(self.mean.dtype) - self.mean) / self.std


class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes, mean, std):
        super().__init__()
        self.normalize = Normalize(mean, std)
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, in_planes = [], 64
        for planes, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            layers += [BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1)]
            in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.linear = nn.Linear(512, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(self.normalize(x))))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


class SmallCNN(nn.Module):
    def __init__(self, num_classes, mean, std):
        super().__init__()
        self.normalize = Normalize(mean, std)
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.GroupNorm(8, 128), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(128, num_classes)

    def forward(self, x):
        out = self.features(self.normalize(x))
        return self.classifier(F.adaptive_avg_pool2d(out, 1).flatten(1))


def resnet18(*, num_classes, mean, std):
    return ResNet18(num_classes, mean, std)


def cnn(*, num_classes, mean, std):
    return SmallCNN(num_classes, mean, std)


ARCHS = {"resnet18": resnet18, "cnn": cnn}  # the --arch choices of the numbered scripts (the first is the default)
