"""The prefill benchmark, both modes (``fp8kv_bench.prefill``): ``python benchmarks/prefill.py --help``."""

from fp8kv_bench import prefill, results

if __name__ == "__main__":
    raise SystemExit(results.main(prefill))
