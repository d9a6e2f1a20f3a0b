"""fp8kv's Triton backend (work in progress)."""
