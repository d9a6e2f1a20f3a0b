"""The transformers precision benchmark (``fp8kv_bench.hf_precision``): ``python benchmarks/hf_precision.py --help``."""

from fp8kv_bench import hf_precision, results

if __name__ == "__main__":
    raise SystemExit(results.main(hf_precision))
