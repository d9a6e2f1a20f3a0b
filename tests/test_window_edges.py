"""The sliding window at its edges, in every CPU kernel, against an independent dense computation.

A window ``W`` keeps the keys ``p`` with ``position - W < p <= position`` (vLLM's and HF's
convention). Off-by-one mistakes hide at the edges, so each step puts sequences where they are:
``W`` equal to the sequence length, one less, one more, and the window's first key exactly at a
block boundary, one past it and one before it; the windows are 1, ``block_size`` and
``block_size`` +- 1 (and one longer than any sequence). Decode (one query per sequence) and
chunked prefill (``query_start_loc``, causal; one sequence prefilled whole, so its first queries see
fewer than ``W`` keys; one step non-causal) run on the reference, the torch backend (its C decode
loop, its float32 paths with and without the log-sum-exp, its float64 soft-capped path) and the
Triton kernels under the interpreter (the decode kernel, the prefill kernel, and both with the keys
cut into splits whose boundary the window crosses).

Each result is compared with :func:`dense_oracle.dense_attention` (float64, written separately)
within the derived float32 tolerance, and :func:`test_each_case_tells_a_window_off_by_one` shows
that the oracle for ``W - 1`` or ``W + 1`` lies outside that tolerance in every row the window cuts,
so a kernel off by one key fails. The GPU kernels: tests/test_window_edges_gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from dense_oracle import dense_attention

import fp8kv
from fp8kv.probe import triton_interpreter
from fp8kv.testing.tolerance import (
    assert_fp8_attention_close,
    assert_lse_close,
    attention_tolerance,
    fp8_attention_tolerance,
    paged_attention_bounds,
)

BS = 4
WINDOWS = (1, BS - 1, BS, BS + 1)
BIG_WINDOW = 2**40
"""Longer than any sequence (and than int32): the kernels clamp it, the result is no window's."""


@dataclass
class Step:
    """One step: a filled cache, the queries and the page table (on ``cache.device``)."""

    cache: fp8kv.KVCache
    query: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    qsl: torch.Tensor
    decode: bool

    @property
    def kwargs(self) -> dict:
        return dict(block_tables=self.tables, seq_lens=self.lens, query_start_loc=None if self.decode else self.qsl)

    def cpu(self) -> Step:
        return replace(self, cache=self.cache.to("cpu"), query=self.query.cpu(), tables=self.tables.cpu(),
                       lens=self.lens.cpu(), qsl=self.qsl.cpu())


def edge_lengths(window: int, block_size: int) -> list[int]:
    """Sequence lengths that put a window of ``window`` keys at its edges, for the query at the end:
    ``W = L``, ``W = L - 1``, ``W = L + 1``, the first key at a block boundary, one past and one before
    it, and a sequence of one key."""
    w, b = window, block_size
    return sorted({w, w + 1, max(w - 1, 1), w + b, w + b + 1, w + 2 * b - 1, 1})


def make_step(lens: list[int], *, decode: bool, block_size: int = BS, num_kv_heads: int = 1, group: int = 2,
              head_size: int = 16, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              prefill_len: int = 3, extra_blocks: int = 0, seed: int = 0, kv_dtype: str = "fp8_e4m3",
              granularity: str = "token_head", query_scale: float = 1.0) -> Step:
    """A step over sequences of ``lens`` keys: one query per sequence (``decode``) or the last
    ``min(L, prefill_len)`` positions of each and every position of the longest. Blocks are shuffled
    in the cache; ``extra_blocks`` widens every block-table row (never read). ``query_scale`` < 1 evens
    out the probabilities, so that every key of a row weighs (the FP8 mode's tolerance is wide)."""
    g = torch.Generator().manual_seed(seed)
    H, D = num_kv_heads, head_size
    nblk = [-(-n // block_size) for n in lens]
    cols = max(nblk) + extra_blocks
    num_blocks = sum(nblk) + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), cols, dtype=torch.int32)
    k = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = torch.tensor(perm[k:k + n], dtype=torch.int32)
        k += n
    scales = {} if granularity == "token_head" else dict(k_scale=torch.full((H,), 0.02), v_scale=torch.full((H,), 0.02))
    cache = fp8kv.KVCache.allocate(num_blocks, block_size, H, D, kv_dtype=kv_dtype, scale_granularity=granularity,
                                   device=device, **scales)
    slots = num_blocks * block_size
    fp8kv.write_kv_one_shot(cache, torch.randn(slots, H, D, generator=g).to(device),
                            torch.randn(slots, H, D, generator=g).to(device), torch.arange(slots, device=device),
                            backend="reference")
    longest = max(range(len(lens)), key=lambda i: lens[i])
    q_lens = [1 if decode else (n if i == longest else min(n, prefill_len)) for i, n in enumerate(lens)]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    query = (query_scale * torch.randn(int(qsl[-1]), H * group, D, generator=g)).to(device, dtype)
    return Step(cache, query, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device), qsl.to(device),
                decode)


def window_step(window: int, *, decode: bool, **kw) -> Step:
    b = kw.get("block_size", BS)
    lens = edge_lengths(b if window == BIG_WINDOW else window, b)
    return make_step(lens, decode=decode, **kw)


_ORACLE: dict = {}


def oracle(step: Step, window: int | None, *, causal: bool = True, cap: float | None = None):
    """float64 ``(out, lse)`` of the dense computation, on the CPU (kept per step: the GPU tests ask
    for the same step's oracle once per backend)."""
    key = (id(step), window, causal, cap)
    if key not in _ORACLE or _ORACLE[key][0] is not step:
        if len(_ORACLE) > 64:
            _ORACLE.clear()
        s = step.cpu()
        _ORACLE[key] = (step, dense_attention(s.query, s.cache, s.tables, s.lens, s.qsl, s.query.shape[-1] ** -0.5,
                                              causal=causal, sliding_window=window, logits_soft_cap=cap,
                                              with_lse=True))
    return _ORACLE[key][1]


def assert_matches_oracle(step: Step, window: int, out: torch.Tensor, lse: torch.Tensor | None = None, *,
                          causal: bool = True, cap: float | None = None, context: str = "") -> None:
    """``out`` (and ``lse``) equal the dense computation for ``window`` within the derived tolerance."""
    s = step.cpu()
    want, want_lse = oracle(step, window, causal=causal, cap=cap)
    bounds = paged_attention_bounds(s.query, s.cache, s.tables, s.lens, s.qsl, causal=causal,
                                    sliding_window=window, logits_soft_cap=cap)
    tol = attention_tolerance(want, **bounds)
    diff = (out.detach().cpu().double() - want).abs()
    if not bool((diff <= tol).all()):
        row = int((diff > tol).any(-1).any(-1).nonzero()[0, 0])
        raise AssertionError(f"{context}: window {window}, row {row} (query_start_loc {s.qsl.tolist()}, seq_lens "
                             f"{s.lens.tolist()}): off by {float(diff[row].max()):.3g}, tolerance "
                             f"{float(tol[row].max()):.3g}")
    if lse is not None:
        assert_lse_close(lse.cpu(), want_lse.float(), **bounds, context=f"{context}: window {window}: ")


def window_cuts(step: Step, window: int, *, causal: bool = True) -> torch.Tensor:
    """``[T]`` bool: rows for which the window leaves out a key the row could otherwise see."""
    rows = []
    starts = step.qsl.tolist()
    for i, n in enumerate(step.lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            pos = n - q_len + j
            rows.append(pos - window >= 0)  # key pos - window is visible without the window (causal or not)
    return torch.tensor(rows, dtype=torch.bool)


def assert_tells_off_by_one(step: Step, window: int, *, causal: bool = True) -> None:
    """In every row the window cuts, the oracle for ``W + 1`` (and ``W - 1``, where that is a window) is
    more than the derived tolerance away from the one for ``W``, so a kernel one key off fails."""
    s = step.cpu()
    want, _ = oracle(step, window, causal=causal)
    bounds = paged_attention_bounds(s.query, s.cache, s.tables, s.lens, s.qsl, causal=causal, sliding_window=window)
    tol = attention_tolerance(want, **bounds).amax(dim=(1, 2))
    assert int(window_cuts(step, window).sum()) >= 4
    for other in (window + 1, window - 1):
        if other < 1:
            continue
        apart = (oracle(step, other, causal=causal)[0] - want).abs().amax(dim=(1, 2))
        where = window_cuts(step, min(window, other))  # the rows where W and W +- 1 see other keys
        assert bool((apart[where] > 2 * tol[where]).all()), (other, (apart[where] / tol[where]).min())


def run_public(step: Step, window: int | None, backend: str, *, causal: bool = True, cap: float | None = None,
               lse: bool = False, **kw):
    meta = fp8kv.plan_attention(step.cache, num_q_heads=step.query.shape[1], query_dtype=step.query.dtype,
                                sliding_window=window, causal=causal, logits_soft_cap=cap, backend=backend,
                                **step.kwargs, **kw)
    got = fp8kv.paged_attention(step.query, step.cache, meta, return_lse=lse)
    return got if lse else (got, None)


KINDS = ("decode", "prefill")


FP8_QUERY_SCALE = 0.25
"""Queries of the FP8-mode cases are this much smaller: near-even probabilities, every key weighs."""


def check_fp8_mode(step: Step, window: int, backend: str, *, causal: bool = True, context: str = "") -> None:
    """``backend`` in the FP8 attention mode equals the reference's FP8 mode within the mode's derived
    tolerance, and that tolerance tells the reference's results for ``W - 1`` and ``W + 1`` from ``W``'s
    in every row where they see other keys (so a window one key off fails in this mode too)."""
    out, lse = run_public(step, window, backend, causal=causal, lse=True, fp8_attention=True)
    ref, ref_lse = run_public(step, window, "reference", causal=causal, lse=True, fp8_attention=True)
    tol, lse_tol = fp8_attention_tolerance(step.query, step.cache, step.tables, step.lens, step.qsl, ref, ref_lse,
                                           causal=causal, sliding_window=window)
    assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse, lse_tol=lse_tol,
                               context=f"{context}: window {window}: ")
    row_tol = tol.amax(dim=(1, 2)).cpu()
    for other in (window + 1, window - 1):
        if other < 1:
            continue
        other_ref, _ = run_public(step, other, "reference", causal=causal, lse=True, fp8_attention=True)
        apart = (other_ref.double() - ref.double()).abs().amax(dim=(1, 2)).cpu()
        where = window_cuts(step, min(window, other))
        assert bool((apart[where] > row_tol[where]).all()), (other, (apart[where] / row_tol[where]).min())


# ------------------------------------------------------------------------------- the cases
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", KINDS)
def test_each_case_tells_a_window_off_by_one(kind, window):
    """In every row the window cuts, the oracle for ``W + 1`` (and for ``W - 1``, where that is a window)
    is farther from the one for ``W`` than the tolerance: a kernel one key off fails."""
    step = window_step(window, decode=kind == "decode")
    assert_tells_off_by_one(step, window)
    lens = step.lens.tolist()
    assert window in lens and window + 1 in lens  # W = L and W = L - 1
    starts = {n - window for n in lens if n > window}  # the decode query's first key
    assert {BS, BS + 1, 2 * BS - 1} <= starts, starts


@pytest.mark.parametrize("window", WINDOWS + (BIG_WINDOW,))
@pytest.mark.parametrize("kind", KINDS)
def test_reference_window_edges(kind, window):
    step = window_step(window, decode=kind == "decode")
    out, lse = run_public(step, window, "reference", lse=True)
    assert_matches_oracle(step, window, out, lse, context="reference")


TORCH_MODES = {  # name -> (FP8KV_TORCH_NATIVE, return_lse, logits_soft_cap)
    "C decode loop": ("1", True, None),
    "float32": ("0", False, None),
    "float32 with lse": ("0", True, None),
    "float64 soft-capped": ("0", True, 30.0),
}


@pytest.mark.parametrize("mode", sorted(TORCH_MODES))
@pytest.mark.parametrize("window", WINDOWS + (BIG_WINDOW,))
@pytest.mark.parametrize("kind", KINDS)
def test_torch_backend_window_edges(monkeypatch, kind, window, mode):
    from fp8kv_torch import native

    use_native, lse, cap = TORCH_MODES[mode]
    monkeypatch.setenv("FP8KV_TORCH_NATIVE", use_native)
    if use_native == "1" and native.library() is None:
        pytest.skip(f"the torch backend's C loops: {native.status()}")
    step = window_step(window, decode=kind == "decode")
    out, got_lse = run_public(step, window, "torch", cap=cap, lse=lse)
    assert_matches_oracle(step, window, out, got_lse, cap=cap, context=f"torch ({mode})")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_non_causal_prefill_window_edges(backend):
    """Non-causal: a row sees ``W - 1`` keys after its own position too, up to the sequence's end."""
    for window in WINDOWS:
        step = window_step(window, decode=False)
        out, lse = run_public(step, window, backend, causal=False, lse=True)
        assert_matches_oracle(step, window, out, lse, causal=False, context=f"{backend} non-causal")


# ------------------------------------------------------------------------- Triton (interpreter)
interpreted = pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreter(),
                                 reason="Triton's CPU interpreter (TRITON_INTERPRET=1, no CUDA)")


@interpreted
@pytest.mark.parametrize("window", WINDOWS + (BIG_WINDOW,))
@pytest.mark.parametrize("kind", KINDS)
def test_triton_window_edges(kind, window):
    """The decode kernel (decode steps) and the prefill kernel, through the public calls."""
    pytest.importorskip("triton")
    step = window_step(window, decode=kind == "decode")
    out, lse = run_public(step, window, "triton", lse=True)
    assert_matches_oracle(step, window, out, lse, context=f"triton {kind}")


@interpreted
@pytest.mark.parametrize("window", [1, BS + 1])
def test_triton_non_causal_prefill_window_edges(window):
    pytest.importorskip("triton")
    step = window_step(window, decode=False)
    out, lse = run_public(step, window, "triton", causal=False, lse=True)
    assert_matches_oracle(step, window, out, lse, causal=False, context="triton non-causal")


@interpreted
@pytest.mark.parametrize("window", [1, BS, BS + 1])
@pytest.mark.parametrize("kind", KINDS)
def test_hopper_fp8_mode_window_edges(kind, window):
    """The Hopper backend's FP8-mode kernel under the interpreter (head size 32, per-head scales)."""
    pytest.importorskip("triton")
    step = window_step(window, decode=kind == "decode", head_size=32, granularity="head", query_scale=FP8_QUERY_SCALE)
    check_fp8_mode(step, window, "hopper", context=f"hopper fp8 {kind}")


SPLIT_KEYS = 32
"""Keys per split of the split-KV launches below (the interpreter's key tile)."""


def split_step(window: int, *, decode: bool) -> Step:
    """Sequences whose window starts at the split boundary ``SPLIT_KEYS``, one before and one after it
    (for the query at the end), and one whose window ends right at it."""
    return make_step([SPLIT_KEYS + window, SPLIT_KEYS + window - 1, SPLIT_KEYS + window + 1, SPLIT_KEYS],
                     decode=decode, prefill_len=2)


@interpreted
@pytest.mark.parametrize("window", [1, BS + 1])
@pytest.mark.parametrize("kind", KINDS)
def test_triton_split_kv_window_edges(kind, window):
    """The window's first key at a split boundary +- 1: the splits' key ranges and the merge."""
    pytest.importorskip("triton")
    from fp8kv_triton.attention import choose_config, paged_attention
    from fp8kv_triton.modes import integer_decoder

    step = split_step(window, decode=kind == "decode")
    max_q = int((step.qsl[1:] - step.qsl[:-1]).max())
    max_keys = step.tables.shape[1] * BS
    base = choose_config(step.query.device, group=step.query.shape[1], head_size=step.query.shape[2],
                         num_seqs=len(step.lens), num_kv_heads=1, max_query_len=max_q, max_keys=max_keys,
                         interpret=True)
    assert SPLIT_KEYS % base.block_n == 0
    config = replace(base, num_splits=-(-max_keys // SPLIT_KEYS), keys_per_split=SPLIT_KEYS)
    assert config.num_splits > 1
    out = torch.full_like(step.query, float("nan"))
    lse = torch.full(step.query.shape[:2], float("nan"))
    paged_attention(step.query, step.cache, step.tables, step.lens, step.qsl, max_q, step.query.shape[-1] ** -0.5,
                    True, window, None, out, lse=lse, decode_mode=integer_decoder(step.cache.kv_dtype),
                    interpret=True, config=config)
    assert_matches_oracle(step, window, out, lse, context=f"triton split-KV {kind}")
