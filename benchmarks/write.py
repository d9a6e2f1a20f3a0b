"""The cache write benchmark (``fp8kv_bench.write``): ``python benchmarks/write.py --help``."""

from fp8kv_bench import results, write

if __name__ == "__main__":
    raise SystemExit(results.main(write))
