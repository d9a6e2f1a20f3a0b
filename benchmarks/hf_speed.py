"""The transformers decode speed benchmark (``fp8kv_bench.hf_speed``): ``python benchmarks/hf_speed.py --help``."""

from fp8kv_bench import hf_speed, results

if __name__ == "__main__":
    raise SystemExit(results.main(hf_speed))
