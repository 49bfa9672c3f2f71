"""The benchmark scripts, one module each, run from the repository root as `python -m benchmarks.NAME --help`
(no sys.path set-up: the root is on the path, opfuse importable from it). benchmarks/README.md lists them;
benchmarks/RESULTS.md and benchmarks/ZOO.md hold what they measured."""
