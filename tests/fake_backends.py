"""Building blocks of the test suite's fake backends."""

from __future__ import annotations

from fp8kv.plugins import BackendInfo, hookimpl


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


class TestBackend:
    """A test backend's info hook: set ``name`` and ``priority`` on the subclass (not "fast": a fake)."""

    name = "test_backend"
    priority = 1

    @hookimpl
    def fp8kv_backend_info(self):
        return BackendInfo(self.name, "0", priority=self.priority, description="test", fast=False)
