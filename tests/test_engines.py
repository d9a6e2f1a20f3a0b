"""The recipes of ``docs/engines.md``: each engine's own cache tensors, wrapped zero-copy.

Every recipe test

* builds the engine's tensors the way the engine allocates them (shape, dtype, stride order,
  one allocation or several, per-layer views) and fills them with random valid codes, which
  stand for the history already cached;
* wraps them with :meth:`fp8kv.KVCache.from_tensors` and plans the step with the engine's own
  index tensors and conventions (int64 where the engine uses int64, CSR for FlashInfer,
  ``req_to_token`` rows as block tables of block_size 1 for SGLang, ``window_left`` for the
  engines that count the window that way);
* writes the step's K/V with ``fp8kv.write_kv(cache, k, v, meta)`` and checks the whole engine
  allocation afterwards: the new tokens' bytes sit at the engine's own address for them
  (computed from the engine's indices, not from fp8kv's slots) and are those the reference
  writes into an ``allocate``'d contiguous cache; every other byte is unchanged;
* checks ``paged_attention`` over the engine's tensors equals, bit for bit, the same call
  (same metadata, same backend) over that contiguous cache, and that the Triton backend
  (through its CPU interpreter) agrees with the reference within the derived tolerance.

Plus: a tensor-parallel rank's slice of the heads (per-head and token_head scales), a
FlashInfer ``(k, v)`` pair with different paddings, and a CSR page table against the
equivalent padded block table.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import fp8kv
from fp8kv import KVCache
from fp8kv.testing import assert_attention_close, paged_attention_bounds

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
_TRITON = pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not _INTERPRETED,
    reason="the Triton backend runs here through its CPU interpreter (TRITON_INTERPRET=1, no CUDA)"))
BACKENDS = ["reference", _TRITON]


# ----------------------------------------------------------------------------- helpers
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fill_codes_(t: torch.Tensor, fp8_dtype: torch.dtype, g: torch.Generator) -> None:
    """Random valid (finite) codes of ``fp8_dtype`` in every byte of ``t`` (any 1-byte dtype):
    the history already cached, and a poison that shows any stray write."""
    t.view(torch.uint8).copy_((torch.randn(t.shape, generator=g) * 3).to(fp8_dtype).view(torch.uint8))


def _twin(cache: KVCache) -> KVCache:
    """An ``allocate``'d contiguous cache with ``cache``'s spec, bytes and scales."""
    static = {} if cache.scale_granularity == "token_head" else {"k_scale": cache.k_scale.clone(),
                                                                 "v_scale": cache.v_scale.clone()}
    twin = KVCache.allocate(cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_size,
                            kv_dtype=cache.kv_dtype, layout=cache.layout,
                            scale_granularity=cache.scale_granularity, **static)
    for mine, theirs in ((twin.key_cache, cache.key_cache), (twin.value_cache, cache.value_cache)):
        mine.view(torch.uint8).copy_(theirs.view(torch.uint8))
    if cache.scale_granularity == "token_head":
        twin.k_scale.copy_(cache.k_scale)
        twin.v_scale.copy_(cache.v_scale)
    assert twin.spec == cache.spec
    return twin


def _slot_bytes(cache: KVCache, which: str, slot: int) -> torch.Tensor:
    """The ``[H, D]`` bytes of one slot of a cache, read through fp8kv's layout."""
    c = (cache.key_cache if which == "key" else cache.value_cache).view(torch.uint8)
    blk, off = divmod(slot, cache.block_size)
    return c[blk, off] if cache.layout == "NHD" else c[blk, :, off]


def _step(cache: KVCache, twin: KVCache, q, k, v, backend: str, out: torch.Tensor | None = None, **plan):
    """Plan, write and attend over the engine's cache with ``backend``; the twin is written by
    the reference and attended with the same metadata. Returns (metadata, output)."""
    meta = fp8kv.plan_attention(cache, num_q_heads=q.shape[1], query_dtype=q.dtype, backend=backend, **plan)
    assert meta.backend == backend
    fp8kv.write_kv(cache, k, v, meta)
    got = fp8kv.paged_attention(q, cache, meta, out=out)

    ref_meta = fp8kv.plan_attention(twin, num_q_heads=q.shape[1], query_dtype=q.dtype, backend="reference", **plan)
    fp8kv.write_kv(twin, k, v, ref_meta)
    same = fp8kv.paged_attention(q, twin, meta)  # the same kernel and launch over contiguous memory
    assert torch.equal(got, same), f"{backend}: attention over the engine's tensors != over a contiguous copy"
    if backend != "reference":
        ref = fp8kv.paged_attention(q, twin, ref_meta)
        o = meta.options
        bounds = paged_attention_bounds(q, twin, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                        softmax_scale=o.softmax_scale, causal=o.causal,
                                        sliding_window=o.sliding_window, logits_soft_cap=o.logits_soft_cap)
        assert_attention_close(got, ref, context=f"{backend} vs reference: ", **bounds)
    return meta, got


def _assert_landed(after: torch.Tensor, before: torch.Tensor, placements) -> None:
    """``after`` (an engine allocation, as bytes) equals ``before`` with exactly ``placements``
    applied: ``(address(t) -> view of t, bytes)`` pairs, the engine's own addressing."""
    expected = before.clone()
    for address, data in placements:
        address(expected).copy_(data)
    assert not torch.equal(expected, before), "the step wrote nothing"
    changed = (after != expected).nonzero()
    assert changed.numel() == 0, f"{len(changed)} bytes differ from the expected engine state, first at " \
                                 f"{changed[0].tolist()}"


def _qkv(T: int, Hq: int, H: int, D: int, dtype: torch.dtype, g: torch.Generator):
    return tuple((torch.randn(T, h, D, generator=g) * s).to(dtype) for h, s in ((Hq, 1.0), (H, 2.0), (H, 1.5)))


# -------------------------------------------------------------------------------- vLLM
def _vllm_flash_kv_cache(num_blocks, block_size, H, D, cache_layout: str, dtype: torch.dtype):
    """vLLM v1's FLASH_ATTN layer cache as the GPU model runner builds it: an int8 byte buffer,
    viewed as the spec's dtype, shaped in the backend's stride order and permuted back to the
    logical ``get_kv_cache_shape`` ``[2, num_blocks, block_size, H, D]``. Returns (raw, kv_cache)."""
    shape = (2, num_blocks, block_size, H, D)  # FlashAttentionBackend.get_kv_cache_shape
    order = (0, 1, 2, 3, 4) if cache_layout == "NHD" else (0, 1, 3, 2, 4)  # get_kv_cache_stride_order
    raw = torch.zeros(2 * num_blocks * block_size * H * D, dtype=torch.int8)  # _allocate_kv_cache_tensors
    inv = [order.index(i) for i in range(5)]
    kv_cache = raw.view(dtype).view(tuple(shape[i] for i in order)).permute(*inv)  # _reshape_kv_cache_tensors
    return raw, kv_cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("storage", [torch.uint8, torch.float8_e4m3fn], ids=["uint8", "float8"])
@pytest.mark.parametrize("cache_layout", ["NHD", "HND"])
def test_vllm_flash_attn_recipe(cache_layout, storage, backend):
    nb, bs, H, D, Hq = 6, 16, 2, 32, 4  # FLASH_ATTN: block_size a multiple of 16
    g = _gen(1)
    raw, kv_cache = _vllm_flash_kv_cache(nb, bs, H, D, cache_layout, storage)
    _fill_codes_(raw, torch.float8_e4m3fn, g)
    k_scale, v_scale = torch.tensor(0.05), torch.tensor(0.04)  # layer._k_scale / _v_scale: float32, shape ()

    cache = KVCache.from_tensors(kv_cache, kv_dtype="fp8_e4m3", kv_dim=0, layout="NHD", k_scale=k_scale,
                                 v_scale=v_scale)
    assert cache.key_cache.data_ptr() == raw.data_ptr() and cache.k_scale.data_ptr() == k_scale.data_ptr()
    assert cache.value_cache.data_ptr() == kv_cache[1].data_ptr()
    assert (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_size) == (nb, bs, H, D)
    twin = _twin(cache)

    # the step (vLLM's CommonAttentionMetadata): a decode, a chunked prefill across a block
    # boundary and a fresh prefill; int32 tables and lengths, int64 slot_mapping
    seq_lens = torch.tensor([21, 19, 6], dtype=torch.int32)
    query_lens = [1, 5, 6]
    block_table_buffer = torch.zeros(8, 4, dtype=torch.int32)  # [max_num_reqs, max_blocks_per_req]
    block_table_buffer[:3, :2] = torch.tensor([[5, 2], [0, 4], [3, 0]], dtype=torch.int32)
    block_table = block_table_buffer[:3]
    query_start_loc = torch.tensor([0, 1, 6, 12], dtype=torch.int32)
    positions = torch.cat([torch.arange(int(n) - q, int(n)) for n, q in zip(seq_lens, query_lens, strict=True)])
    req = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens))
    slot_mapping = (block_table[req, positions // bs].long() * bs + positions % bs)  # int64, as vLLM's

    n, padded = 12, 16  # vLLM pads the batch (CUDA graphs); the metadata covers the real tokens
    q, k, v = _qkv(padded, Hq, H, D, torch.bfloat16, g)
    output = torch.full((padded, Hq, D), 7.0, dtype=torch.bfloat16)  # the layer's output buffer
    before = raw.view(torch.uint8).clone()
    window = {} if storage == torch.uint8 else {"sliding_window": 7}  # vLLM's W: (W - 1, 0) in flash-attn
    _, out = _step(cache, twin, q[:n], k[:n], v[:n], backend, out=output[:n], block_tables=block_table,
                   seq_lens=seq_lens, query_start_loc=query_start_loc, slot_mapping=slot_mapping,
                   host_seq_lens=seq_lens.tolist(), host_query_start_loc=query_start_loc.tolist(),  # vLLM's *_cpu
                   **window)
    assert out.data_ptr() == output.data_ptr() and bool((output[n:] == 7.0).all())

    # where reshape_and_cache_flash puts token i: kv_cache[0|1][slot // bs, slot % bs] of the
    # logical view, i.e. physical [kv, block, offset] (NHD) or [kv, block, :, offset] (HND)
    phys = raw.view(torch.uint8).view((2, nb, bs, H, D) if cache_layout == "NHD" else (2, nb, H, bs, D))
    placements = []
    for s in slot_mapping.tolist():  # reshape_and_cache_flash: block_idx = slot // bs, offset = slot % bs
        blk, off = divmod(s, bs)
        for kv, which in ((0, "key"), (1, "value")):
            if cache_layout == "NHD":
                address = lambda t, kv=kv, blk=blk, off=off: t.view(phys.shape)[kv, blk, off]
            else:
                address = lambda t, kv=kv, blk=blk, off=off: t.view(phys.shape)[kv, blk, :, off]
            placements.append((address, _slot_bytes(twin, which, s)))
    _assert_landed(raw.view(torch.uint8), before, placements)


# -------------------------------------------------------------------------- FlashInfer
def _flashinfer_step():
    """A FlashInfer append step over 3 requests: CSR page table and qo_indptr (all int32)."""
    kv_indptr = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    kv_indices = torch.tensor([4, 0, 6, 2, 5, 1], dtype=torch.int32)
    kv_last_page_len = torch.tensor([3, 8, 1], dtype=torch.int32)
    qo_indptr = torch.tensor([0, 4, 5, 7], dtype=torch.int32)
    return kv_indptr, kv_indices, kv_last_page_len, qo_indptr


def _flashinfer_append(kv_indptr, kv_indices, kv_last_page_len, qo_indptr, page_size):
    """What ``append_paged_kv_cache`` is given and where it stores each token.

    Returns ``batch_indices`` and ``positions`` (int32, as ``get_batch_indices_positions``: the
    appended tokens are the last ``qo_len`` of each request, ``get_seq_lens`` long) and, per token,
    the ``(page, entry)`` the append kernel writes: ``kv_indices[kv_indptr[b] + pos // page_size]``,
    ``pos % page_size``.
    """
    seq_lens = (kv_indptr[1:] - kv_indptr[:-1] - 1).clamp(min=0) * page_size + kv_last_page_len
    batch_indices, positions, addresses = [], [], []
    for b in range(len(seq_lens)):
        q_len = int(qo_indptr[b + 1] - qo_indptr[b])
        for pos in range(int(seq_lens[b]) - q_len, int(seq_lens[b])):
            batch_indices.append(b)
            positions.append(pos)
            addresses.append((int(kv_indices[int(kv_indptr[b]) + pos // page_size]), pos % page_size))
    as32 = lambda x: torch.tensor(x, dtype=torch.int32)
    return as32(batch_indices), as32(positions), addresses


def _flashinfer_slots(kv_indptr, kv_indices, batch_indices, positions, page_size):
    """The recipe's translation (docs/engines.md) of FlashInfer's append inputs into slots."""
    return kv_indices[kv_indptr[batch_indices] + positions // page_size] * page_size + positions % page_size

def _flashinfer_paged_step(cache, twin, backend, page, heads, dtype, g, **options):
    """One FlashInfer-style step (CSR page table, ``qo_indptr``, appended slots) through :func:`_step`;
    returns each new token's ``(page, entry)`` address and the slots it was written to."""
    kv_indptr, kv_indices, kv_last_page_len, qo_indptr = _flashinfer_step()
    batch_indices, positions, addresses = _flashinfer_append(kv_indptr, kv_indices, kv_last_page_len, qo_indptr,
                                                             page)
    slot_mapping = _flashinfer_slots(kv_indptr, kv_indices, batch_indices, positions, page)
    q, k, v = _qkv(len(addresses), *heads, dtype, g)
    _step(cache, twin, q, k, v, backend, kv_indptr=kv_indptr, kv_indices=kv_indices,
          kv_last_page_len=kv_last_page_len, query_start_loc=qo_indptr, slot_mapping=slot_mapping, **options)
    return addresses, slot_mapping



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_flashinfer_paged_kv_cache_recipe(kv_layout, backend):
    P, page, H, D, Hq = 7, 8, 2, 32, 4
    g = _gen(2)
    shape = (P, 2, page, H, D) if kv_layout == "NHD" else (P, 2, H, page, D)
    paged_kv_cache = torch.empty(shape, dtype=torch.float8_e4m3fn)
    _fill_codes_(paged_kv_cache, torch.float8_e4m3fn, g)

    cache = KVCache.from_tensors(paged_kv_cache, layout=kv_layout, k_scale=0.05, v_scale=0.04)  # kv_dim=1
    assert cache.key_cache.data_ptr() == paged_kv_cache.data_ptr()
    assert cache.value_cache.data_ptr() == paged_kv_cache[:, 1].data_ptr()
    twin = _twin(cache)

    before = paged_kv_cache.view(torch.uint8).clone()
    # FlashInfer's window_left: W - 1 keys left of the query (-1: no window)
    addresses, slot_mapping = _flashinfer_paged_step(cache, twin, backend, page, (Hq, H, D), torch.float16, g,
                                                     window_left=5)

    placements = []
    for i, (p, e) in enumerate(addresses):
        s = int(slot_mapping[i])
        for kv, which in ((0, "key"), (1, "value")):
            address = (lambda t, kv=kv, p=p, e=e: t[p, kv, e]) if kv_layout == "NHD" else \
                (lambda t, kv=kv, p=p, e=e: t[p, kv, :, e])
            placements.append((address, _slot_bytes(twin, which, s)))
    _assert_landed(paged_kv_cache.view(torch.uint8), before, placements)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flashinfer_kv_pair_with_different_paddings(backend):
    """FlashInfer's ``(k_cache, v_cache)`` tuple: two allocations, each padded its own way
    (K: wider head rows; V: extra pages and entries, and a storage offset), e5m2."""
    P, page, H, D, Hq = 7, 8, 2, 16, 2
    g = _gen(3)
    k_alloc = torch.empty(P, page, H, D + 16, dtype=torch.float8_e5m2)
    v_alloc = torch.empty(P + 2, page + 3, H, D, dtype=torch.float8_e5m2)
    for t in (k_alloc, v_alloc):
        _fill_codes_(t, torch.float8_e5m2, g)
    k_cache, v_cache = k_alloc[..., :D], v_alloc[1:P + 1, 2:page + 2]
    assert k_cache.stride() != v_cache.stride()

    cache = KVCache.from_tensors(k_cache, v_cache, scale_granularity="head",
                                 k_scale=torch.tensor([0.06, 0.03]), v_scale=torch.tensor([0.02, 0.05]))
    assert cache.kv_dtype == "fp8_e5m2"
    assert cache.key_cache.data_ptr() == k_alloc.data_ptr() and cache.value_cache.data_ptr() == v_cache.data_ptr()
    twin = _twin(cache)

    before = [t.view(torch.uint8).clone() for t in (k_alloc, v_alloc)]
    addresses, slot_mapping = _flashinfer_paged_step(cache, twin, backend, page, (Hq, H, D), torch.float32, g,
                                                     window_left=-1)

    for alloc, old, which in ((k_alloc, before[0], "key"), (v_alloc, before[1], "value")):
        placements = []
        for i, (p, e) in enumerate(addresses):
            address = (lambda t, p=p, e=e: t[p, e, :, :D]) if which == "key" else \
                (lambda t, p=p, e=e: t[1 + p, 2 + e])
            placements.append((address, _slot_bytes(twin, which, int(slot_mapping[i]))))
        _assert_landed(alloc.view(torch.uint8), old, placements)


@pytest.mark.parametrize("backend", BACKENDS)
def test_csr_page_table_equals_padded_block_tables(backend):
    """The same step planned from FlashInfer's CSR (int32) and from a padded block table
    (int64, junk past each sequence's pages) attends identically, bit for bit."""
    P, page, H, D, Hq = 7, 8, 2, 16, 4
    g = _gen(4)
    cache = KVCache.allocate(P, page, H, D)
    _fill_codes_(cache.key_cache, torch.float8_e4m3fn, g)
    _fill_codes_(cache.value_cache, torch.float8_e4m3fn, g)
    kv_indptr, kv_indices, kv_last_page_len, qo_indptr = _flashinfer_step()
    q = torch.randn(int(qo_indptr[-1]), Hq, D, generator=g)

    csr = fp8kv.plan_attention(cache, num_q_heads=Hq, query_dtype=q.dtype, kv_indptr=kv_indptr,
                               kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
                               query_start_loc=qo_indptr, max_blocks=4, window_left=6, backend=backend)
    seq_lens = ((kv_indptr[1:] - kv_indptr[:-1] - 1) * page + kv_last_page_len).long()
    block_tables = torch.full((3, 4), -1, dtype=torch.int64)
    for b in range(3):
        pages = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])]
        block_tables[b, :len(pages)] = pages
    padded = fp8kv.plan_attention(cache, num_q_heads=Hq, query_dtype=q.dtype, block_tables=block_tables,
                                  seq_lens=seq_lens, query_start_loc=qo_indptr.long(), sliding_window=7,
                                  backend=backend)
    assert torch.equal(csr.seq_lens, padded.seq_lens) and csr.seq_lens.dtype == torch.int32
    for b in range(3):
        used = int(kv_indptr[b + 1] - kv_indptr[b])
        assert torch.equal(csr.block_tables[b, :used], padded.block_tables[b, :used])
    assert csr.options == padded.options
    assert torch.equal(fp8kv.paged_attention(q, cache, csr), fp8kv.paged_attention(q, cache, padded))


# ------------------------------------------------------------------------------ SGLang
@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_token_pool_recipe(backend):
    size, H, D, Hq, layer_num, max_ctx = 40, 2, 16, 4, 2, 16
    g = _gen(5)
    # MHATokenToKVPool(size, page_size=1, dtype=float8_e4m3fn, ...): store_dtype uint8, one
    # [size + page_size, head_num, head_dim] buffer per layer; slot 0 is the padding slot
    k_buffer = [torch.zeros(size + 1, H, D, dtype=torch.uint8) for _ in range(layer_num)]
    v_buffer = [torch.zeros(size + 1, H, D, dtype=torch.uint8) for _ in range(layer_num)]
    for t in k_buffer + v_buffer:
        _fill_codes_(t, torch.float8_e4m3fn, g)
    layer = 1
    cache = KVCache.from_tensors(k_buffer[layer][:, None], v_buffer[layer][:, None], kv_dtype="fp8_e4m3",
                                 k_scale=0.05, v_scale=0.04)  # block_size 1: [size + 1, 1, H, D]
    assert cache.block_size == 1 and cache.num_blocks == size + 1
    assert cache.key_cache.data_ptr() == k_buffer[layer].data_ptr()
    twin = _twin(cache)
    sliding_window_size = 3  # RadixAttention's: config.sliding_window - 1, -1 when off

    req_to_token = torch.zeros(8, max_ctx, dtype=torch.int32)  # ReqToTokenPool.req_to_token
    free = (torch.randperm(size, generator=g) + 1).tolist()  # TokenToKVPoolAllocator: slots 1..size
    prefix = [free.pop() for _ in range(5)]  # request 1's cached prefix (radix cache hit)
    req_to_token[1, :5] = torch.tensor(prefix, dtype=torch.int32)

    def check_step(req_pool_indices, seq_lens, extend_lens, out_cache_loc):
        seq_lens = torch.tensor(seq_lens, dtype=torch.int64).clamp(min=1)  # a padded request holds 0 or 1
        plan = dict(block_tables=req_to_token[req_pool_indices][:, :int(seq_lens.max())], seq_lens=seq_lens,
                    slot_mapping=out_cache_loc.masked_fill(out_cache_loc == 0, -1),  # padding: slot 0 -> -1
                    window_left=sliding_window_size)
        if extend_lens is not None:
            plan["query_start_loc"] = torch.cat([torch.zeros(1, dtype=torch.int64),
                                                 torch.tensor(extend_lens).cumsum(0)])
        q, k, v = _qkv(len(out_cache_loc), Hq, H, D, torch.bfloat16, g)
        before = [t.clone() for t in k_buffer + v_buffer]
        _step(cache, twin, q, k, v, backend, **plan)
        for lyr in range(layer_num):  # set_kv_buffer: k_buffer[layer][loc] = cache_k
            for buf, old, which in ((k_buffer[lyr], before[lyr], "key"), (v_buffer[lyr], before[layer_num + lyr],
                                                                            "value")):
                if lyr != layer:
                    assert torch.equal(buf, old), "another layer's buffer changed"
                    continue
                placements = [(lambda t, loc=loc: t[loc], _slot_bytes(twin, which, loc))
                              for loc in out_cache_loc.tolist() if loc != 0]
                _assert_landed(buf, old, placements)

    # extend: request 1 (prefix 5, extends 3), request 2 (fresh, 4 tokens); out_cache_loc int64
    locs = [free.pop() for _ in range(7)]
    req_to_token[1, 5:8] = torch.tensor(locs[:3], dtype=torch.int32)
    req_to_token[2, :4] = torch.tensor(locs[3:], dtype=torch.int32)
    check_step(torch.tensor([1, 2]), [8, 4], [3, 4], torch.tensor(locs, dtype=torch.int64))

    # decode, padded to a CUDA-graph batch of 4: padding requests have req_pool_index 0,
    # out_cache_loc 0 (the dummy slot) and the backend's seq_len fill value (0 or 1)
    locs = [free.pop() for _ in range(2)]
    req_to_token[1, 8], req_to_token[2, 4] = locs
    check_step(torch.tensor([1, 2, 0, 0]), [9, 5, 0, 1], None, torch.tensor(locs + [0, 0], dtype=torch.int64))


# ---------------------------------------------------------------------------- LMDeploy
def lmdeploy_window_left(window_size: int | None) -> int:
    """LMDeploy's ``window_size`` (the model's ``config.sliding_window``, passed unchanged; its
    kernels keep keys ``>= q_pos - window_size``; ``None``/``<= 0``: off) as ``window_left``."""
    return window_size if window_size is not None and window_size > 0 else -1


@pytest.mark.parametrize("backend", BACKENDS)
def test_lmdeploy_recipe(backend):
    num_layers, nb, bs, H, D, Hq = 2, 6, 16, 2, 16, 4
    g = _gen(6)
    # CacheEngine._allocate_cache with quant_policy=FP8: one [num_layers, num_blocks, *block_shape]
    # tensor each for K and V, block shape (block_size, num_heads, head_size) on CUDA
    key_caches = torch.empty(num_layers, nb, bs, H, D, dtype=torch.float8_e4m3fn)
    value_caches = torch.empty(num_layers, nb, bs, H, D, dtype=torch.float8_e4m3fn)
    for t in (key_caches, value_caches):
        _fill_codes_(t, torch.float8_e4m3fn, g)
    layer = 1
    cache = KVCache.from_tensors(key_caches[layer], value_caches[layer], k_scale=0.05, v_scale=0.04)
    assert cache.key_cache.data_ptr() == key_caches[layer].data_ptr()
    twin = _twin(cache)

    # StepContext: int64 block_offsets, q_start_loc (starts), q_seqlens and kv_seqlens (history + new)
    block_offsets = torch.tensor([[2, 5, 0], [4, 0, 0]], dtype=torch.int64)
    q_seqlens = torch.tensor([7, 5], dtype=torch.int64)
    kv_seqlens = torch.tensor([20, 5], dtype=torch.int64)  # request 0: 13 cached + 7 new, across a block
    q_start_loc = q_seqlens.cumsum(0) - q_seqlens
    # the recipe's slots (docs/engines.md), computed from LMDeploy's own step tensors
    req = torch.repeat_interleave(torch.arange(len(q_seqlens)), q_seqlens)
    pos = (kv_seqlens - q_seqlens)[req] + torch.arange(len(req)) - q_start_loc[req]
    slot_mapping = block_offsets[req, pos // bs] * bs + pos % bs
    # fill_kv_cache: token i of request b at position history_len + i
    tokens = [(b, int(kv_seqlens[b] - q_seqlens[b]) + i) for b in range(2) for i in range(int(q_seqlens[b]))]
    q, k, v = _qkv(len(tokens), Hq, H, D, torch.float16, g)
    before = [key_caches.view(torch.uint8).clone(), value_caches.view(torch.uint8).clone()]
    _step(cache, twin, q, k, v, backend, block_tables=block_offsets, seq_lens=kv_seqlens,
          query_start_loc=torch.cat([q_start_loc, (q_start_loc[-1] + q_seqlens[-1]).view(1)]),
          slot_mapping=slot_mapping, window_left=lmdeploy_window_left(4))

    for alloc, old, which in ((key_caches, before[0], "key"), (value_caches, before[1], "value")):
        placements = []
        for i, (b, p) in enumerate(tokens):
            address = lambda t, b=b, p=p: t[layer, int(block_offsets[b, p // bs]), p % bs]
            placements.append((address, _slot_bytes(twin, which, int(slot_mapping[i]))))
        _assert_landed(alloc.view(torch.uint8), old, placements)


def test_lmdeploy_window_conventions():
    """LMDeploy's window_size 0 and -1 (and None) are off; a positive one keeps window_size keys
    left of the query, so it is window_left as is (HF's sliding_window W then sees W + 1 keys)."""
    assert [lmdeploy_window_left(w) for w in (None, -1, 0, 1, 4096)] == [-1, -1, -1, 1, 4096]
    g = _gen(7)
    cache = KVCache.allocate(4, 4, 1, 16)
    _fill_codes_(cache.key_cache, torch.float8_e4m3fn, g)
    _fill_codes_(cache.value_cache, torch.float8_e4m3fn, g)
    q = torch.randn(1, 2, 16, generator=g)
    bt, lens = torch.tensor([[3, 1, 0]]), torch.tensor([10])
    run = lambda **w: fp8kv.paged_attention_one_shot(q, cache, bt, lens, backend="reference", **w)
    assert torch.equal(run(window_left=lmdeploy_window_left(0)), run())
    assert torch.equal(run(window_left=lmdeploy_window_left(4)), run(sliding_window=5))
    assert not torch.equal(run(sliding_window=5), run(sliding_window=4))


# ----------------------------------------------------------------------- tensor parallel
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_rank_slice_with_per_head_scales(backend):
    """Rank 1 of 2 over a vLLM-style ``[2, num_blocks, block_size, 4, D]`` cache: its two KV
    heads, wrapped zero-copy with its slice of the per-head scales; writes touch only its heads."""
    nb, bs, H, D, tp, rank = 4, 16, 4, 16, 2, 1
    g = _gen(8)
    raw, kv_cache = _vllm_flash_kv_cache(nb, bs, H, D, "NHD", torch.uint8)
    _fill_codes_(raw, torch.float8_e4m3fn, g)
    k_scale, v_scale = torch.tensor([0.02, 0.03, 0.05, 0.04]), torch.tensor([0.06, 0.01, 0.03, 0.02])
    lo, hi = rank * H // tp, (rank + 1) * H // tp

    mine = KVCache.from_tensors(kv_cache[..., lo:hi, :], kv_dtype="fp8_e4m3", kv_dim=0, scale_granularity="head",
                                k_scale=k_scale[lo:hi], v_scale=v_scale[lo:hi])
    full = KVCache.from_tensors(kv_cache, kv_dtype="fp8_e4m3", kv_dim=0, scale_granularity="head",
                                k_scale=k_scale, v_scale=v_scale)
    sliced = full.slice_heads(lo, hi)
    assert mine.spec == sliced.spec and mine.num_kv_heads == hi - lo
    for a, b in ((mine.key_cache, sliced.key_cache), (mine.value_cache, sliced.value_cache),
                 (mine.k_scale, sliced.k_scale), (mine.v_scale, sliced.v_scale)):
        assert a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    assert mine.k_scale.data_ptr() == k_scale[lo].data_ptr() and mine.v_scale.tolist() == v_scale[lo:hi].tolist()
    twin = _twin(mine)

    seq_lens = torch.tensor([18, 3], dtype=torch.int32)
    block_table = torch.tensor([[3, 1], [0, 0]], dtype=torch.int32)
    slot_mapping = torch.tensor([1 * bs + 1, 0 * bs + 2])
    q, k, v = _qkv(2, 2 * (hi - lo), hi - lo, D, torch.bfloat16, g)
    before = raw.view(torch.uint8).clone()
    _step(mine, twin, q, k, v, backend, block_tables=block_table, seq_lens=seq_lens, slot_mapping=slot_mapping)

    phys = (2, nb, bs, H, D)
    placements = [(lambda t, kv=kv, s=s: t.view(phys)[kv, s // bs, s % bs, lo:hi], _slot_bytes(twin, which, s))
                  for s in slot_mapping.tolist() for kv, which in ((0, "key"), (1, "value"))]
    _assert_landed(raw.view(torch.uint8), before, placements)  # the other rank's heads untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_rank_slice_with_token_head_scales(backend):
    """``slice_heads`` of a token_head cache over an engine's K, V and ``[num_blocks,
    block_size, H]`` scale tensors: the rank's scales are written in the engine's tensors."""
    nb, bs, H, D, lo, hi = 4, 8, 4, 16, 2, 4
    g = _gen(9)
    k_alloc = torch.empty(nb, bs, H, D, dtype=torch.uint8)
    v_alloc = torch.empty(nb, bs, H, D, dtype=torch.uint8)
    for t in (k_alloc, v_alloc):
        _fill_codes_(t, torch.float8_e4m3fn, g)
    k_scales, v_scales = (torch.rand(nb, bs, H, generator=g) * 0.05 + 0.01 for _ in range(2))
    full = KVCache.from_tensors(k_alloc, v_alloc, kv_dtype="fp8_e4m3", scale_granularity="token_head",
                                k_scale=k_scales, v_scale=v_scales)
    assert full.k_scale.data_ptr() == k_scales.data_ptr()
    mine = full.slice_heads(lo, hi)
    assert mine.k_scale.data_ptr() == k_scales[..., lo].data_ptr() and mine.k_scale.shape == (nb, bs, hi - lo)
    twin = _twin(mine)

    seq_lens = torch.tensor([11, 6], dtype=torch.int64)
    block_table = torch.tensor([[2, 0], [3, 0]], dtype=torch.int64)
    slot_mapping = torch.tensor([0 * bs + 2, 3 * bs + 5], dtype=torch.int64)
    q, k, v = _qkv(2, 4, hi - lo, D, torch.float16, g)
    before = [t.clone() for t in (k_alloc, v_alloc, k_scales, v_scales)]
    _step(mine, twin, q, k, v, backend, block_tables=block_table, seq_lens=seq_lens, slot_mapping=slot_mapping)

    for alloc, old, which in ((k_alloc, before[0], "key"), (v_alloc, before[1], "value")):
        _assert_landed(alloc, old, [(lambda t, s=s: t[s // bs, s % bs, lo:hi], _slot_bytes(twin, which, s))
                                    for s in slot_mapping.tolist()])
    for scales, old, theirs in ((k_scales, before[2], twin.k_scale), (v_scales, before[3], twin.v_scale)):
        expected = old.clone()
        for s in slot_mapping.tolist():
            expected[s // bs, s % bs, lo:hi] = theirs[s // bs, s % bs]
        assert torch.equal(scales.view(torch.int32), expected.view(torch.int32))
        assert not torch.equal(scales, old)
