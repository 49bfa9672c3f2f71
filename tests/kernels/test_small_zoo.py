"""Small versions of the zoo's convnets, compiled whole through Triton's interpreter: every kernel passes its own
check, no group runs through PyTorch but views, and the model matches eager on fresh inputs.

Each architecture's building blocks at a few channels and 32 px, so that a change which breaks one kind of
block breaks CI, not only a GPU run (densenet121's batch norm before its 1x1 convs failed to compile from 850d773
to 04b0f4e, and no test compiled a DenseNet layer's norm as a prologue)."""

from __future__ import annotations

import pytest
import torch
import torchvision

import opfuse
from opfuse.fusion.reasons import Code
from opfuse.numerics import relative_error
from tests.kernels.builders import with_random_batch_norms

pytestmark = pytest.mark.slow


def densenet():
    return torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, num_classes=10)


def shufflenet():
    return torchvision.models.ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 128], num_classes=10)


def resnext():
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=8, num_classes=10)


def regnet():
    from torchvision.models.regnet import BlockParams, RegNet

    return RegNet(BlockParams.from_init_params(depth=3, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25),
                  num_classes=10)


def efficientnet():
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    setting = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(4, 3, 2, 8, 16, 2), MBConvConfig(4, 5, 2, 16, 24, 1)]
    return EfficientNet(setting, dropout=0.0, num_classes=10)


def convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    model = ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 1)], num_classes=10)
    for name, parameter in model.named_parameters():     # layer scales as trained ones are, not 1e-6
        if name.endswith("layer_scale"):
            torch.nn.init.uniform_(parameter, 0.1, 0.2)
    return model


def mobilenet():
    return torchvision.models.MobileNetV2(width_mult=0.25, num_classes=10)


@pytest.mark.parametrize("build", [densenet, shufflenet, resnext, regnet, efficientnet, convnext, mobilenet],
                         ids=lambda build: build.__name__)
def test_a_small_zoo_convnet_compiles_every_group_and_matches_eager(build):
    torch.manual_seed(0)
    model = with_random_batch_norms(build()).eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    failed = {c.group: c.detail for c in compiled.checks if not c.passed}
    assert compiled.checks and not failed, failed
    through_pytorch = {g: why.text for g, why in compiled.fallbacks.items() if why.code is not Code.VIEW}
    assert not through_pytorch, through_pytorch
    fresh = torch.randn_like(x)
    with torch.no_grad():
        assert relative_error(compiled(fresh), model(fresh)) < 1e-4
