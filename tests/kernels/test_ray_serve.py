"""The README's serving recipe, run: a package behind Ray Serve (examples/04_ray_serve.py), 2 replicas on the CPU
(Triton's interpreter in each), concurrent requests batched by `@serve.batch` into the package's dynamic batch dim,
every answer equal to eager."""

import concurrent.futures
import importlib.util
from pathlib import Path

import pytest
import torch

serve = pytest.importorskip("ray.serve")

import opfuse  # noqa: E402
from opfuse.runtime.package import file_sha256  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def example():
    spec = importlib.util.spec_from_file_location("ray_serve_example", ROOT / "examples" / "04_ray_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()


def served_by_each(handle, count: int) -> dict:
    """{replica's process id: its batches by size} of `count` replicas: a call reaches the one the router picks, which
    with idle replicas may be the same one many times over, so calls go 8 at a time until each has answered."""
    replicas: dict = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(50):
            replicas.update(pool.map(lambda _: handle.served_batches.remote().result(), range(8)))
            if len(replicas) == count:
                break
    return replicas


def test_two_replicas_serve_concurrent_requests_batched_equal_to_eager(tmp_path):
    import ray
    from torch.export import Dim

    model = mlp()
    dynamic = opfuse.compile(model, (torch.randn(2, 8),), opfuse.FusionConfig(dtype="float32"),
                             dynamic_shapes=({0: Dim("batch", max=4)},))
    dynamic.compile_buckets()
    path = opfuse.save(dynamic, tmp_path / "mlp.opfuse")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"TRITON_INTERPRET": "1"}})
    try:
        serve.start(http_options={"location": "NoServer"})
        handle = serve.run(example().app(str(path), file_sha256(path), replicas=2, gpus=0, device="cpu"), name="mlp")
        rows = [torch.randn(8, generator=torch.Generator().manual_seed(i)) for i in range(16)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda row: handle.predict.remote(row).result(), rows))
        with torch.no_grad():
            for row, answer in zip(rows, answers):
                torch.testing.assert_close(answer, model(row[None])[0], rtol=1e-4, atol=1e-5)
        replicas = served_by_each(handle, 2)
        rows_served = sum(size * count for batches in replicas.values() for size, count in batches.items())
        assert rows_served == len(rows)
        assert max(size for batches in replicas.values() for size in batches) > 1, replicas   # batched together
    finally:
        serve.shutdown()
        ray.shutdown()
