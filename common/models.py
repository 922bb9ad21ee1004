"""The networks: each takes uint8 images [N, 3, H, W], normalises them itself, and takes num_classes
and the data's per-channel mean and std (0-1 scale) as keywords. resnet18 (default): the CIFAR-10
ResNet-18 of kuangliu/pytorch-cifar (3x3 stem, no max-pool; 93.02% there with SGD and a cosine
schedule), 11.2 M parameters, 20 batch norms. cnn: 0.09 M parameters for CPU runs and tests, with
GroupNorm (per image: a batch split across processes gives the same gradient). cnn_bn: the same cnn
with batch norm, for CPU runs that need what ResNet-18's batch norm brings (buffers, per-process
statistics, train and eval modes) at the small cnn's cost.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .cli import UserError


class Normalize(nn.Module):
    """uint8 images [0, 255] in, (x - mean) / std per channel out, in the model's dtype;
    float input is refused."""

    def __init__(self, mean, std):
        super().__init__()
        # The buffers are code, not weights.
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1) * 255, persistent=False)

    def forward(self, x):
        if x.dtype != torch.uint8:
            raise UserError(f"the model normalises uint8 images itself but got {x.dtype} ones: "
                            "give it the images as uint8 (0-255), or a model without "
                            "models.Normalize")
        return (x.to(self.mean.dtype) - self.mean) / self.std


class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        project = stride != 1 or in_planes != planes
        self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                                      nn.BatchNorm2d(planes)) if project else nn.Sequential()

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


class resnet18(nn.Module):  # noqa: N801 (named as torchvision's constructors are)
    def __init__(self, *, num_classes, mean, std):
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
        out = self.layers(F.relu(self.bn1(self.conv1(self.normalize(x)))))
        return self.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))


class cnn(nn.Module):  # noqa: N801
    def __init__(self, *, num_classes, mean, std, batch_norm=False):
        super().__init__()
        self.normalize = Normalize(mean, std)
        layers = []
        for in_channels, channels in [(3, 32), (32, 64), (64, 128)]:
            norm = nn.BatchNorm2d(channels) if batch_norm else nn.GroupNorm(8, channels)
            conv = nn.Conv2d(in_channels, channels, 3, padding=1)
            layers += [conv, norm, nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(128, num_classes)

    def forward(self, x):
        out = self.features(self.normalize(x))
        return self.classifier(F.adaptive_avg_pool2d(out, 1).flatten(1))


def cnn_bn(*, num_classes, mean, std):
    return cnn(num_classes=num_classes, mean=mean, std=std, batch_norm=True)
