"""Building blocks of the test suite's fake backends."""

from __future__ import annotations

from fp8kv.plugins import hookimpl


class ReferenceOps:
    """Op hooks that delegate to the reference: a test backend adds its own info and supports hooks."""

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        from fp8kv import reference

        reference.write_kv(cache, key, value, slot_mapping)

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata, out, lse):
        from fp8kv import reference

        reference.paged_attention(query, cache, metadata, out, lse)
