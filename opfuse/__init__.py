"""opfuse: an operator-fusion compiler for deep-learning inference.

capture (torch.export | ONNX) -> IR graph -> passes (fold constants and BN, DCE, verify) -> fusion plan
   -> Triton codegen per group -> autotune (resource-checked) -> compiled runtime (+ CUDA graph)
                                  \\-> analysis (traffic, launches, memory, roofline) -> report

Public API: `compile(model, example_inputs, config)`, `analyze(model, example_inputs, config)`, `FusionConfig`,
`save(compiled, path)` and `load(path)` (deploy a compiled model as one package file, `opfuse.runtime.package`),
`compile_generator(model, max_batch, max_seq_len, config)` (text generation with a KV cache, `opfuse.generate`),
and `torch.compile(model, backend="opfuse")`.

Importing opfuse is cheap: `compile` and `analyze` (and torch with them) load on first use, and the dynamo backend
registers itself when torch._dynamo is imported (at once if it already is), so the command line's --help and
usage errors never wait for torch. An installed opfuse is also found through its `torch_dynamo_backends` entry point.
"""

import importlib.abc
import importlib.util
import sys

from opfuse.config import FusionConfig

__all__ = ["analyze", "compile", "compile_generator", "FusionConfig", "load", "save"]
__version__ = "0.1.0"

_LAZY = {"analyze": "opfuse.api", "compile": "opfuse.compiler", "save": "opfuse.runtime.package",
         "load": "opfuse.runtime.package", "compile_generator": "opfuse.generate"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'opfuse' has no attribute {name!r}")


def _register_backend() -> None:
    try:
        from opfuse.backend import register

        register()
    except Exception:   # an old or stripped torch without dynamo: compile() still works
        pass


class _RegisterWhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Registers backend="opfuse" right after torch._dynamo is first imported, by whatever imports it."""

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)                   # find the real module, once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register_backend()

        spec.loader.exec_module = exec_then_register
        return spec


if "torch._dynamo" in sys.modules:
    _register_backend()
else:
    sys.meta_path.insert(0, _RegisterWhenDynamoLoads())
