"""Small versions of the zoo's models, compiled whole through Triton's interpreter: every kernel passes its own
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


def assert_compiles_whole(model, example, fresh):
    """`model` compiled on `example` (float32): every kernel passed its check, nothing but views runs through
    PyTorch, and the output on `fresh` matches eager."""
    compiled = opfuse.compile(model, (example,), opfuse.FusionConfig(dtype="float32"))
    failed = {c.group: c.detail for c in compiled.checks if not c.passed}
    assert compiled.checks and not failed, failed
    through_pytorch = {g: why.text for g, why in compiled.fallbacks.items() if why.code is not Code.VIEW}
    assert not through_pytorch, through_pytorch
    with torch.no_grad():
        assert relative_error(compiled(fresh), model(fresh)) < 1e-4


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
    assert_compiles_whole(model, x, torch.randn_like(x))


def bert():
    from opfuse.bench.zoo_models import build_text_model

    return build_text_model("bert", vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=16)


def gpt2():
    from opfuse.bench.zoo_models import build_text_model

    return build_text_model("gpt2", vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
                            eos_token_id=0)


def t5_encoder():
    from opfuse.bench.zoo_models import build_text_model

    return build_text_model("t5_encoder", vocab_size=50, d_model=16, num_layers=2, num_heads=2, d_ff=32, d_kv=8)


@pytest.mark.parametrize("build", [bert, gpt2, t5_encoder], ids=lambda build: build.__name__)
def test_a_small_zoo_transformer_compiles_every_group_and_matches_eager(build):
    pytest.importorskip("transformers")
    from opfuse.bench.zoo import build_seeded, token_inputs

    model = build_seeded(build)
    (ids,) = token_inputs(2, 8, 50)
    assert_compiles_whole(model, ids, (ids * 7 + 3) % 50)     # other tokens than the example's


def vit():
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                hidden_dim=16, mlp_dim=32, num_classes=10)


def swin():
    return torchvision.models.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                              window_size=[4, 4], num_classes=10)


@pytest.mark.parametrize("build", [vit, swin], ids=lambda build: build.__name__)
def test_a_small_zoo_vision_transformer_compiles_every_group_and_matches_eager(build):
    """At a batch over 1, so that ViT's head split (nn.MultiheadAttention's) is no view of its own
    (`opfuse.passes.fold_view_chains` reads it as one)."""
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    assert_compiles_whole(model, x, torch.randn_like(x))
