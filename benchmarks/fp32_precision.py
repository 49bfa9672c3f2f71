"""End-to-end error of one zoo model compiled in float32, under one tl.dot precision for float32 operands.

    OUT=out python -m benchmarks.fp32_precision MODEL PRECISION

PRECISION: tf32, tf32x3 (`opfuse.numerics.TF32_DOT` set to it; cuDNN's tf32 switch left on, as by default) or ieee
(cuDNN's tf32 switch off, so every float32 dot of opfuse and of eager runs in full float32). Prints and writes
$OUT/MODEL-PRECISION.json: the relative error of opfuse and of eager PyTorch in float32 against float64 eager on
fresh inputs (batch 1), the compile seconds (tune_top 2, verification off: the error is the result), and the
median time of each (`opfuse.bench.timing.median_ms`; run 79 timed 20 calls with a helper of its own). Run 79 ran
twelve of these at once on one GPU: its times compare only roughly; its errors are what it is for.
"""

import copy
import json
import os
import sys
import time

import torch

import opfuse
import opfuse.numerics as numerics
from opfuse.bench.timing import median_ms
from opfuse.bench.zoo import load_builtin
from opfuse.numerics import relative_error


def main(name: str, precision: str) -> dict:
    if precision == "ieee":
        torch.backends.cudnn.allow_tf32 = False
    else:
        numerics.TF32_DOT = precision
    model, inputs = load_builtin(name, batch=1)
    reference_model = copy.deepcopy(model).double().cuda()
    model = model.float().cuda()
    inputs = tuple(x.cuda() for x in inputs)
    start = time.perf_counter()
    compiled = opfuse.compile(model, inputs, opfuse.FusionConfig(dtype="float32", verify=False, tune_top=2))
    seconds = time.perf_counter() - start
    torch.manual_seed(1)
    fresh = tuple(torch.randn_like(x) for x in inputs)
    with torch.inference_mode():
        for _ in range(1 + compiled.compiled.cuda_graph_warmup):
            out = compiled(*fresh)
        reference = reference_model(*(x.double() for x in fresh))
        eager = model(*fresh)
        row = dict(model=name, precision=precision, opfuse_error=relative_error(out, reference),
                   eager_error=relative_error(eager, reference), compile_s=round(seconds, 1),
                   opfuse_ms=median_ms(compiled, fresh), eager_ms=median_ms(model, fresh))
    with open(os.path.join(os.environ.get("OUT", "."), f"{name}-{precision}.json"), "w") as f:
        json.dump(row, f)
    return row


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
