"""benchmarks/depthwise_sweep.py's candidates, on the CPU (nothing timed): with `twins`, every tile whose taps the
kernel would unroll is timed in a row loop too, and nothing else changes."""

from pathlib import Path

from opfuse.codegen.base import import_file

sweep = import_file(Path(__file__).resolve().parents[2] / "benchmarks" / "depthwise_sweep.py", "depthwise_sweep")


def tiles(configs, kind: str) -> list[str]:
    return [sweep.describe(c).rsplit("/", 1)[0] for c in configs if sweep.describe(c).endswith(kind)]


def test_each_unrolled_tile_has_a_row_loop_twin():
    for taps in (9, 25, 49):
        plain, twins = sweep.configs(taps), sweep.configs(taps, twins=True)
        unrolled = tiles(plain, "/unrolled")
        assert unrolled, taps                                   # some tile of each filter fits unrolled
        assert tiles(twins, "/unrolled") == unrolled
        assert set(tiles(twins, "/rows")) == set(tiles(plain, "/rows")) | set(unrolled)
        assert len(twins) == len(plain) + len(unrolled)
        assert [c for c in twins if sweep.form(c) == "runs"] == [c for c in plain if sweep.form(c) == "runs"]
