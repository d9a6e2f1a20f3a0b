"""The decode sweep over shapes (``fp8kv_bench.decode_sweep``): ``python benchmarks/decode_sweep.py --help``."""

from fp8kv_bench import decode_sweep, results

if __name__ == "__main__":
    raise SystemExit(results.main(decode_sweep))
