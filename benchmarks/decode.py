"""The paged decode benchmark (``fp8kv_bench.decode``): ``python benchmarks/decode.py --help``."""

from fp8kv_bench import decode, results

if __name__ == "__main__":
    raise SystemExit(results.main(decode))
