"""opfuse: an operator-fusion compiler for deep-learning inference.

capture (torch.export | ONNX) -> IR graph -> passes (fold BN, DCE, verify) -> fusion plan
   -> Triton codegen per group -> autotune (resource-checked) -> compiled runtime (+ CUDA graph)
                                  \\-> analysis (traffic, launches, memory, roofline) -> report
"""

from opfuse.config import FusionConfig

__all__ = ["FusionConfig"]
__version__ = "0.1.0"
