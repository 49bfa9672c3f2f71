"""Text generation: opfuse's generator against torch.compile and eager on the same KV-cache decoder (issue 52).

The measuring is `opfuse.bench.generation` (also `opfuse bench llama-1.1b --generate`); this script runs it over
several batches and prompt lengths, one model, one process, and writes DIR/generate.json after every run:

    python -m benchmarks.generate --out DIR [--batches 1,8,32] [--prompts 128,1024] [--new 256] [--tiny]
                                  [--contenders opfuse,inductor]
    python -m benchmarks.generate --out DIR --merge A/generate.json B/generate.json

--tiny runs the 2-layer "llama-tiny" (a dry run; on the CPU through TRITON_INTERPRET=1). --merge joins runs made in
processes of their own (one contender each, as RESULTS.md's illegal memory access with both in one process asks)
into one generate.json: the contenders of equal (batch, prompt, new) runs side by side, each run's eager and
decode report from the first file that has them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompts", default="128,1024")
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of hidden 64: a dry run")
    parser.add_argument("--contenders", default="opfuse,inductor", help="beside eager, which always runs")
    parser.add_argument("--merge", nargs="+", metavar="GENERATE_JSON", help="join these runs' results instead")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        from opfuse.bench.generation_report import merge

        merged = merge([json.loads(Path(path).read_text()) for path in args.merge])
        (out / "generate.json").write_text(json.dumps(merged, indent=1, default=str))
        return 0
    from opfuse.bench.generation import llama, run_generation

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = llama("llama-tiny" if args.tiny else "llama-1.1b", device, dtype)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "dtype": str(dtype), "runs": []}
    names = set(args.contenders.split(",")) | {"eager"}
    for batch in map(int, args.batches.split(",")):
        for prompt in map(int, args.prompts.split(",")):
            results["runs"].append(run_generation(model, batch, prompt, args.new, names))
            print(json.dumps(results["runs"][-1]["contenders"]), flush=True)
            (out / "generate.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
