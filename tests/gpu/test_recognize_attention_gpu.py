"""recognize_attention on the GPU: a model compiled there is captured with its constants on the device."""

import pytest
import torch

from opfuse.passes import recognize_attention
from tests.unit.test_recognize_attention import _written_out

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def test_the_mask_is_made_where_the_constants_are():
    """Run 30: swin_t compiled on the GPU failed with 'Expected all tensors to be on the same device': the pass
    evaluated the mask on the CPU from constants captured on the GPU."""
    graph = _written_out(mask="bias", reshaped=True)
    graph.constants = {name: tensor.cuda() for name, tensor in graph.constants.items()}
    after, _ = recognize_attention(graph)
    (sdpa,) = [n for n in after if n.op == "sdpa"]
    assert after.constants[sdpa.inputs[3]].device.type == "cuda"


def test_constants_on_the_gpu_and_the_cpu_make_one_mask_on_the_gpu():
    """Run 31: swin_t compiled on the GPU still failed so: its weights were on the GPU and a constant made at
    capture on the CPU, and the mask was evaluated from both."""
    graph = _written_out(mask="bias", reshaped=True)
    names = [name for name, tensor in graph.constants.items() if tensor.numel() > 1]
    assert names
    graph.constants = {name: tensor.cuda() if name == names[0] else tensor
                       for name, tensor in graph.constants.items()}
    after, _ = recognize_attention(graph)
    (sdpa,) = [n for n in after if n.op == "sdpa"]
    assert after.constants[sdpa.inputs[3]].device.type == "cuda"
