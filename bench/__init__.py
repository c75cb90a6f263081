"""moefx's benchmarks. A package so that each benchmark imports the shared harness (`bench.harness`), the stage
table (`bench.stages`) and its page section (`bench.sections`) by name; run a benchmark as a script from the
repository root: `python bench/<name>.py`."""
