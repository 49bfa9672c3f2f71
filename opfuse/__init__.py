"""opfuse: an operator-fusion compiler for deep-learning inference.

capture (torch.export | ONNX) -> IR graph -> passes (fold BN, DCE, verify) -> fusion plan
   -> Triton codegen per group -> autotune (resource-checked) -> compiled runtime (+ CUDA graph)
                                  \\-> analysis (traffic, launches, memory, roofline) -> report

Public API: `compile(model, example_inputs, config)`, `analyze(model, example_inputs, config)`, `FusionConfig`,
and `torch.compile(model, backend="opfuse")`.
"""

from opfuse.api import analyze
from opfuse.compiler import compile
from opfuse.config import FusionConfig

__all__ = ["analyze", "compile", "FusionConfig"]
__version__ = "0.1.0"


def _register_backend() -> None:
    try:
        from opfuse.backend import register

        register()
    except Exception:   # an old or stripped torch without dynamo: compile() still works
        pass


_register_backend()
