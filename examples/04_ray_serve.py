"""Serve an opfuse package behind Ray Serve: one replica per GPU, requests batched by Ray's `@serve.batch` into the
package's dynamic batch dim.

    pip install "ray[serve]"
    opfuse compile bert --dynamic batch=1:32,seq=1:128 -o bert.opfuse      # prints the package's sha256
    python examples/04_ray_serve.py bert.opfuse --sha256 HEX --replicas 2   # one replica per GPU
    curl -s localhost:8000/ -d '{"inputs": [[101, 2023, 2003, 102]]}'        # one request: one row of the batch

Ray routes requests to replicas and `@serve.batch` gathers those arriving together into one list; the replica
stacks them along the batch dim and calls the package once, which runs the batch on its bucket (padded where the
plan allows: docs/deploy.md). Requests of one batch must share the other dims (a sequence length, say): a server
of varying lengths sends each length to its own batch, or pads them itself under an attention mask. Each replica
loads the package once (`opfuse.load`, pinned by its sha256) and compiles nothing.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from typing import Any

import torch
from ray import serve


@serve.deployment
class PackagedModelServer:
    """One replica: a loaded package, called on batches of requests (each request one row, without the batch dim)."""

    def __init__(self, path: str, sha256: str | None = None, device: str | None = None):
        import opfuse

        self.model = opfuse.load(path, device, sha256=sha256)
        batch = next((dim for dim in self.model.dims if (0, 0) in dim.uses), None)
        if batch is None:
            raise ValueError(f"{path} has no dynamic batch dim (dim 0 of its first input): compile it with "
                             "--dynamic batch=1:N")
        index = self.model.dims.index(batch)
        self.predict.set_max_batch_size(max(sizes[index] for sizes in self.model.sizes_held))
        self.batches: Counter[int] = Counter()       # how many batches of each size this replica ran

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def predict(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """The model on the requests gathered together, stacked along the batch dim; one output row each."""
        self.batches[len(rows)] += 1
        with torch.inference_mode():
            outputs = self.model(torch.stack([row.to(self.model.device) for row in rows]))
        return list(outputs.cpu().unbind(0))

    async def __call__(self, request: Any) -> dict[str, Any]:
        """HTTP: {"inputs": one row as nested lists} -> {"outputs": its output row}."""
        body = await request.json()
        row = torch.tensor(body["inputs"], dtype=self.model.input_dtypes[0])
        return {"outputs": (await self.predict(row)).tolist()}

    def served_batches(self) -> tuple[int, dict[int, int]]:
        """(this replica's process id, how many batches of each size it ran)."""
        return os.getpid(), dict(self.batches)


def app(path: str, sha256: str | None = None, replicas: int = 1, gpus: float = 1.0, device: str | None = None):
    """The deployment: `replicas` replicas of the package at `path`, each with `gpus` GPUs (0: on the CPU)."""
    options = {"num_gpus": gpus} if gpus else {"num_cpus": 0.5}
    return PackagedModelServer.options(num_replicas=replicas, ray_actor_options=options).bind(path, sha256, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("package")
    parser.add_argument("--sha256", help="the package's sha256 (opfuse compile prints it): any other file is refused")
    parser.add_argument("--replicas", type=int, default=1, help="replicas, one GPU each (default 1)")
    args = parser.parse_args()
    serve.run(app(args.package, args.sha256, args.replicas), blocking=True)


if __name__ == "__main__":
    main()
