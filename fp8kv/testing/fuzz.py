"""``fp8kv.testing.fuzz``: random sequences of API calls, every call held to the reference.

A Hypothesis state machine (:func:`api_machine`) builds caches (``allocate``, ``from_tensors`` over
engine-style views: one ``[2, ...]`` tensor, FlashInfer's ``[pages, 2, ...]``, padded blocks, HND
storage seen as NHD, uint8 storage, the constructor, ``dataclasses.replace``), derives caches from them
(``slice_heads``, ``clone``, ``copy_``, ``to``), tampers with their tensors after they were built, plans
steps (padded and CSR page tables, decode and chunked prefill, causal or not, sliding windows, soft-caps,
the FP8 attention mode, values checked or not), writes (planned and one-shot), attends (planned and
one-shot, with and without ``return_lse`` and ``out=``) and merges attention states, with the backends
it is given. A share of the calls gets an invalid input: a wrong shape, dtype, device or type, an
out-of-range or repeated slot, a bad scale, a length past the table, a negative value, an empty step...

Every call has an expected outcome (:class:`Case`) and is checked (:meth:`Harness.call`):

* ``valid``: it must succeed (a forced backend may answer :class:`fp8kv.Unsupported`), and its result
  equal the reference backend's: writes bit-exact (every byte of every storage the fuzzer knows is
  compared with what :func:`fp8kv.reference.write_kv` does to a copy), attention within the derived
  tolerance of :mod:`fp8kv.testing.tolerance` (output and log-sum-exp; the FP8 mode's own tolerance for
  its calls);
* ``refuse``: it must raise an :class:`fp8kv.Fp8KVError` whose message names the argument, and change
  nothing;
* ``either`` (unchecked garbage: ``validate=False``, scales changed in place): success equal to the
  reference (which defines what garbage means: see :mod:`fp8kv.reference`), or an Fp8KVError with
  nothing changed;
* ``memory`` (unchecked bounds a kernel relies on, e.g. a ``max_query_len`` too small with the checks
  off): any output values, but no exception other than Fp8KVError and no byte changed outside ``out``.

In every case: never another exception type (an op hook's failure, :class:`fp8kv.BackendFailure`, counts
as one), inputs never modified, and no byte of any tracked storage changes unless the reference says it
does. Cache tensors are built as views into larger buffers filled with canary bytes (NaN payloads), so
an out-of-bounds write lands in a tracked byte and an out-of-bounds read in a NaN.

Use from a test suite (keep the shapes tiny under Triton's interpreter)::

    from fp8kv.testing.fuzz import FuzzConfig, api_machine

    TestApiFuzz = api_machine(FuzzConfig(backends=("reference", "torch"))).TestCase

A case family (``Case.family``, printed with every failure) can be left out while its fix is pending
(``FuzzConfig(leave_out=frozenset({"cache.copy_other_spec"}))``); keep the found sequence as a plain
regression test built on :class:`Harness`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .. import reference
from ..api import merge_attention_states, paged_attention, paged_attention_one_shot, write_kv, write_kv_one_shot
from ..cache import KVCache, may_share_bytes
from ..checks import values_checked
from ..errors import BackendFailure, Fp8KVError, Unsupported
from ..formats import FORMATS
from ..metadata import AttentionMetadata
from ..planning import plan_attention
from .fp8_tolerance import assert_fp8_attention_close, fp8_attention_tolerance
from .safety import as_bits
from .tolerance import assert_attention_close, assert_lse_close, paged_attention_bounds
from .units import U32, ulp

__all__ = [
    "EITHER", "MEMORY", "OK", "REFUSE", "STATS", "VALID", "ApiMachine", "Case", "FuzzConfig", "FuzzFailure", "Harness",
    "Planned", "Tracked", "api_machine", "guarded", "merge_tolerance",
]

VALID, REFUSE, EITHER, MEMORY = "valid", "refuse", "either", "memory"
_LOOSENESS = {VALID: 0, EITHER: 1, MEMORY: 2}


class FuzzFailure(AssertionError):
    """A call broke the invariant (the message names the call, its case family and what broke)."""


@dataclass(frozen=True)
class Case:
    """What a call is expected to do.

    Attributes:
        kind: ``valid``, ``refuse``, ``either`` or ``memory`` (see the module docstring).
        family: what was drawn, e.g. ``"plan.seq_lens.negative"`` (``"valid"`` for plain calls).
        names: the argument names a refusal's message may name (any one); for ``either``: what a
            refusal may name instead of the other case's argument when both are combined.
    """

    kind: str = VALID
    family: str = "valid"
    names: tuple[str, ...] = ()

    def __add__(self, other: Case) -> Case:
        """Both at once: a refusal wins (either's names accepted); else the looser kind."""
        if other.family == "valid":
            return self
        if self.family == "valid":
            return other
        family = self.family if other.family == self.family else f"{self.family}+{other.family}"
        if REFUSE in (self.kind, other.kind):  # the other part may be refused first, naming its own argument
            return Case(REFUSE, family, tuple(dict.fromkeys(self.names + other.names)))
        kind = max(self.kind, other.kind, key=_LOOSENESS.__getitem__)
        return Case(kind, family)


OK = Case()


@dataclass(frozen=True)
class FuzzConfig:
    """What the machine draws (keep it tiny under Triton's interpreter).

    Attributes:
        backends: the backends calls are forced to (``"auto"`` allowed); the oracle is always the reference.
        device: where the tensors live.
        kv_dtypes, layouts, granularities, io_dtypes: the cache formats and I/O dtypes drawn.
        block_sizes, max_blocks, kv_heads, gqa_ratios, head_sizes, max_seqs, max_table_cols: geometry.
        invalid: the share of calls given an invalid input; unchecked: of steps planned with
            ``validate=False`` (garbage values then have the reference's meaning instead of a refusal).
        fp8_attention: draw the FP8 attention mode where the cache allows it.
        leave_out: case families not drawn (prefixes match: ``"tamper"`` leaves out every tampering).
        check_names: a refusal must name one of the case's arguments.
    """

    backends: tuple[str, ...] = ("reference", "torch", "triton")
    device: str = "cpu"
    kv_dtypes: tuple[str, ...] = tuple(FORMATS)
    layouts: tuple[str, ...] = ("NHD", "HND")
    granularities: tuple[str, ...] = ("tensor", "head", "token_head")
    io_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    block_sizes: tuple[int, ...] = (2, 3, 4)
    max_blocks: int = 6
    kv_heads: tuple[int, ...] = (1, 2)
    gqa_ratios: tuple[int, ...] = (1, 2)
    head_sizes: tuple[int, ...] = (4, 8, 16)
    max_seqs: int = 3
    max_table_cols: int = 3
    invalid: float = 0.3
    unchecked: float = 0.15
    fp8_attention: bool = True
    leave_out: frozenset[str] = frozenset()
    check_names: bool = True

    def drawn(self, family: str) -> bool:
        """Whether ``family`` may be drawn (not left out, by itself or a prefix)."""
        parts = family.split(".")
        return not any(".".join(parts[:i]) in self.leave_out for i in range(1, len(parts) + 1))


# ------------------------------------------------------------------------------------------- memory


CANARY_BYTES = (0x7F, 0xFF, 0x80, 0x5A)
"""Guard bytes around uint8 cache storage: NaN in the OCP formats (0x7F, 0xFF) and fnuz (0x80)."""
CANARY_F32 = 0x7FA5A5A5
"""Guard words around float32 scale storage: a NaN with a payload."""
CANARIES = " (canaries)"
"""The suffix of a guarded buffer's label (its tensors are labelled on their own)."""


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage, as a 1-d uint8 view."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,))


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Mirror:
    """Copies of the tracked storages, on which the reference plays what a call should have done."""

    def __init__(self, copies: dict[int, torch.Tensor]) -> None:
        self.bytes = copies

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s view on the copy of its storage."""
        b = self.bytes[_key(t)]
        return b.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def cache(self, c: KVCache) -> KVCache:
        """``c`` over the copies (same views, same spec)."""
        return KVCache.unchecked(self.tensor(c.key_cache), self.tensor(c.value_cache), self.tensor(c.k_scale),
                                 self.tensor(c.v_scale), c.fmt, c.layout, c.scale_granularity, c.spec)


class World:
    """Every storage the fuzzer made or was handed (caches, scales, ``out`` buffers), with the bytes last
    verified: after each call, all of them must hold what the reference says, none other may change."""

    def __init__(self) -> None:
        self.bytes: dict[int, torch.Tensor] = {}
        self.model: dict[int, torch.Tensor] = {}
        self.labels: list[tuple[int, int, int, str]] = []  # (storage, first byte, last byte, name)

    def track(self, t: Any, label: str) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
            return
        k = _key(t)
        if k not in self.bytes:
            self.bytes[k] = storage_bytes(t)
            self.model[k] = self.bytes[k].clone()
        if t.numel():
            lo = t.storage_offset() * t.element_size()
            span = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
            self.labels.append((k, lo, lo + (span + 1) * t.element_size() - 1, label))

    def track_cache(self, c: KVCache, label: str) -> None:
        for name in ("key_cache", "value_cache", "k_scale", "v_scale"):
            self.track(getattr(c, name), f"{label}.{name}")

    def accept(self) -> None:
        """The current bytes become the verified ones (after the fuzzer itself filled or changed tensors)."""
        self.model = {k: b.clone() for k, b in self.bytes.items()}

    def expected(self) -> Mirror:
        return Mirror({k: m.clone() for k, m in self.model.items()})

    def verify(self, expected: Mirror | None, what: str) -> None:
        """Every tracked storage holds ``expected`` (the last verified bytes where None); then the
        verified bytes become the current ones."""
        for k, b in self.bytes.items():
            want = self.model[k] if expected is None else expected.bytes[k]
            if not torch.equal(b, want):
                at = int((b != want).nonzero()[0, 0])
                inside = [name for key, lo, hi, name in self.labels if key == k and lo <= at <= hi]
                tensors = [name for name in inside if not name.endswith(CANARIES)]
                where = ", ".join(dict.fromkeys(tensors)) if tensors else \
                    f"a guard byte of {inside[0][:-len(CANARIES)] if inside else 'a buffer'}, outside every tensor"
                raise FuzzFailure(f"{what}: memory differs from the reference's at {int((b != want).sum())} bytes; "
                                  f"first at byte {at} of a storage ({where}): got 0x{int(b[at]):02x}, expected "
                                  f"0x{int(want[at]):02x}")
        self.model = {k: b.clone() for k, b in self.bytes.items()}


def guarded(numel: int, dtype: torch.dtype, device: torch.device, world: World, label: str, *,
            pad: int | None = None) -> torch.Tensor:
    """A 1-d ``numel``-element region of ``dtype`` in the middle of a buffer of canaries, ``pad`` elements
    on each side (default: as many as the region, at least 64), tracked by ``world``."""
    pad = max(64, numel) if pad is None else max(pad, 16)
    size = torch.empty((), dtype=dtype).element_size()
    n = (2 * pad + numel) * size
    if dtype == torch.float32:
        buf = torch.full((n // 4,), CANARY_F32, dtype=torch.int32, device=device).view(torch.uint8)
    else:
        pattern = torch.tensor(CANARY_BYTES, dtype=torch.uint8)
        buf = pattern.repeat(-(-n // len(CANARY_BYTES)))[:n].to(device)
    region = buf.view(dtype)[pad:pad + numel]
    world.track(buf, f"{label}{CANARIES}")
    return region


def _finite_codes(fmt_name: str, shape, g: torch.Generator) -> torch.Tensor:
    """Random codes of the format, none of them NaN or infinite."""
    fmt = FORMATS[fmt_name]
    bad = torch.tensor(fmt.nan_encodings + fmt.inf_encodings, dtype=torch.uint8)
    b = torch.randint(0, 256, tuple(shape), generator=g, dtype=torch.uint8)
    return torch.where(torch.isin(b, bad), b & 0x0F, b)


# ------------------------------------------------------------------------------------------- state


@dataclass
class Tracked:
    """A cache the fuzzer holds, and what was done to it.

    Attributes:
        cache: the cache.
        label: its name in failure messages (``cache3``).
        broken: a tensor was re-pointed at smaller storage after it was built: every op must refuse.
        suspect: a tensor or scale was changed in place after it was built (values unchecked): ops may
            refuse, else they must match the reference.
    """

    cache: KVCache
    label: str
    broken: bool = False
    suspect: bool = False

    def case(self, op: str = "") -> Case:
        """What any call on this cache is (``op``: a cache method, named in the family)."""
        where = f"{op}." if op else ""
        if self.broken:
            return Case(REFUSE, f"{where}tamper.shrink", ("key_cache", "value_cache", "k_scale", "v_scale", "cache"))
        if self.suspect:
            return Case(EITHER, f"{where}tamper.in_place", ("key_cache", "value_cache", "k_scale", "v_scale", "cache"))
        return OK


@dataclass
class Planned:
    """A metadata the fuzzer planned, with what its calls are expected to do.

    Attributes:
        meta: the :class:`fp8kv.AttentionMetadata`.
        backend: the backend it was planned for.
        attention: the case of attending with it (``either``/``memory`` for unchecked garbage).
        write: the case of writing with it.
    """

    meta: AttentionMetadata
    backend: str
    attention: Case = OK
    write: Case = OK


@dataclass
class Stats:
    """Outcomes per operation and case kind (what a run exercised)."""

    counts: Counter = field(default_factory=Counter)
    families: Counter = field(default_factory=Counter)

    def add(self, op: str, outcome: str, family: str = "") -> None:
        self.counts[(op, outcome)] += 1
        if family:
            self.families[(op, family)] += 1


STATS = Stats()
"""Outcomes of every harness in this process (``STATS.counts``: (op, outcome) -> calls)."""


# ------------------------------------------------------------------------------------------- checks


def _ranges(meta: AttentionMetadata, T: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """Each sequence's query rows as the reference reads them (clamped), and which rows exactly one
    sequence covers (the rows whose result is defined)."""
    starts = meta.query_start_loc.tolist()
    ranges = [(min(max(starts[i], 0), T), min(max(starts[i + 1], 0), T)) for i in range(meta.num_seqs)]
    cover = torch.zeros(T, dtype=torch.int64)
    for lo, hi in ranges:
        if hi > lo:
            cover[lo:hi] += 1
    return ranges, cover == 1


def _bounds(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, ranges) -> tuple[dict, bool]:
    """The derived tolerance's bounds per row, over the keys each row may see (garbage block ids read as
    in-range ones: a superset of the visible keys, so never tighter), and whether those keys are finite."""
    T, Hq, D = query.shape
    opts, nb, bs = meta.options, cache.num_blocks, cache.block_size
    dev = query.device
    max_keys = meta.block_tables.shape[1] * bs
    tables = meta.block_tables.to(torch.int64).clamp(0, nb - 1)
    lens = meta.seq_lens.tolist()
    nk = torch.zeros(T, 1, 1, dtype=torch.float64, device=dev)
    lb = torch.zeros(T, Hq, 1, dtype=torch.float64, device=dev)
    va = torch.zeros(T, Hq, 1, dtype=torch.float64, device=dev)
    deq = [cache.token_view(w).to(torch.float64) * cache.scale_per_slot(w).to(torch.float64)[..., None]
           for w in ("key", "value")]
    finite = True
    for i, (lo, hi) in enumerate(ranges):
        if hi <= lo:
            continue
        n = min(max(lens[i], 0), max_keys)
        pos = torch.arange(n, device=dev)
        slots = tables[i][pos // bs] * bs + pos % bs
        finite = finite and all(bool(torch.isfinite(d[slots]).all()) for d in deq)
        b = paged_attention_bounds(query[lo:hi], cache, tables[i:i + 1], torch.tensor([n], device=dev),
                                   torch.tensor([0, hi - lo], device=dev), softmax_scale=opts.softmax_scale,
                                   causal=opts.causal, sliding_window=opts.sliding_window,
                                   logits_soft_cap=opts.logits_soft_cap)
        nk[lo:hi], lb[lo:hi], va[lo:hi] = b["num_keys"], b["logit_bound"], b["v_absmax"]
    return ({"out_dtype": query.dtype, "head_size": D, "num_keys": nk, "logit_bound": lb, "v_absmax": va,
             "soft_cap": opts.logits_soft_cap}, finite)


def check_attention_values(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, out: torch.Tensor,
                           lse: torch.Tensor | None, *, what: str) -> bool:
    """``out`` (and ``lse``) equal the reference's within the derived tolerance, on the rows whose result
    is defined. Returns False when skipped: non-finite keys or values are visible (NaN propagation is not
    held to a tolerance), or the FP8 mode over garbage metadata."""
    T = query.shape[0]
    if T == 0:
        return True
    ranges, defined = _ranges(meta, T)
    ref = torch.zeros_like(query)
    ref_lse = torch.zeros(query.shape[:2], dtype=torch.float32, device=query.device)
    reference.paged_attention(query, cache, meta, ref, ref_lse)
    bounds, finite = _bounds(query, cache, meta, ranges)
    if not finite:
        return False
    rows = defined.nonzero().flatten().to(query.device)
    context = f"{what}: "
    try:
        if meta.options.fp8_attention:
            if not bool(defined.all()):
                return False
            opts = meta.options
            qsl = None if meta.is_decode else meta.query_start_loc
            tol, lse_tol = fp8_attention_tolerance(
                query, cache, meta.block_tables, meta.seq_lens, qsl, ref, ref_lse if lse is not None else None,
                softmax_scale=opts.softmax_scale, causal=opts.causal, sliding_window=opts.sliding_window,
                logits_soft_cap=opts.logits_soft_cap, q_scale=opts.q_scale, prob_scale=opts.prob_scale)
            assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse if lse is not None else None,
                                       lse_tol=lse_tol, context=context)
            return True
        sub = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in bounds.items()}
        assert_attention_close(out[rows], ref[rows], **sub, context=context)
        if lse is not None:
            assert_lse_close(lse[rows], ref_lse[rows], **sub, context=context)
    except AssertionError as exc:
        raise FuzzFailure(str(exc)) from None
    return True


def merge_tolerance(out_a: torch.Tensor, out_b: torch.Tensor, ref: torch.Tensor, ref_lse: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element tolerances of :func:`fp8kv.merge_attention_states` against its formula in float64.

    The merge computes in float32 (``u = 2^-24``) from float32 log-sum-exps: ``m`` is one of them exactly,
    each weight ``e^{lse - m}`` is off by at most ``u |d| e^d + 2u <= 3u`` absolutely (``d <= 0``, an
    exact-or-rounded difference and an exp within an ulp), their sum (``>= 1``) by ``7u``, each normalised
    weight by ``12u``; the two products and the sum add three roundings of at most ``u (|a| + |b|)``:
    ``E = 16 u (|out_a| + |out_b|)``, then the output dtype's rounding, ``ulp(|ref| + E)``. The lse,
    ``m + log(total)`` with ``log(total) <= ln 2``: ``16 u + 2 u |lse|``.
    """
    a, b = out_a.detach().to(torch.float64).abs(), out_b.detach().to(torch.float64).abs()
    E = 16 * U32 * (a + b)
    mag = ref.to(torch.float64).abs() + E
    tol = E + ulp(mag, out_a.dtype)
    tol = torch.where(mag > torch.finfo(out_a.dtype).max, torch.full_like(tol, math.inf), tol)
    lse_tol = 16 * U32 + 2 * U32 * ref_lse.to(torch.float64).abs()
    return tol, lse_tol


def merge_reference(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented merge in float64: ``(e^{lse_a} a + e^{lse_b} b) / (e^{lse_a} + e^{lse_b})``."""
    la, lb = lse_a.to(torch.float64), lse_b.to(torch.float64)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = out_a.to(torch.float64) * (wa / safe)[..., None] + out_b.to(torch.float64) * (wb / safe)[..., None]
    lse = torch.where(total > 0, m + torch.log(safe), torch.full_like(m, -math.inf))
    return out, lse


def _close(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> bool:
    g, w = got.detach().to(torch.float64), want.to(torch.float64)
    return bool(((g == w) | (torch.isnan(g) & torch.isnan(w)) | ((g - w).abs() <= tol)).all())


# ------------------------------------------------------------------------------------------- harness


class Harness:
    """The checked calls (usable without Hypothesis, e.g. for regression tests).

    Every method takes the :class:`Case` the call is expected to be, runs it, and raises
    :class:`FuzzFailure` if the outcome breaks the invariant (see the module docstring); it returns the
    call's result, or None when the call was refused.
    """

    def __init__(self, config: FuzzConfig | None = None) -> None:
        self.config = config or FuzzConfig()
        self.device = torch.device(self.config.device)
        self.log: Callable[[str], None] | None = None
        self.world = World()
        self.calls = 0

    def guarded_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, *,
                      kv_dtype: str = "fp8_e4m3", layout: str = "NHD", scale_granularity: str = "tensor",
                      label: str = "cache", seed: int = 0, **scales) -> Tracked:
        """A valid cache whose K and V are one ``[2, ...]`` view in a buffer of canaries, filled with random
        finite codes (token_head scales: a guarded ``[2, ...]`` view of ones); ``scales``: static k/v scales."""
        shape = ((num_blocks, block_size, num_kv_heads, head_size) if layout == "NHD"
                 else (num_blocks, num_kv_heads, block_size, head_size))
        fmt = FORMATS[kv_dtype]
        kv = guarded(2 * math.prod(shape), torch.uint8, self.device, self.world, f"{label}.kv").view(2, *shape)
        kv.copy_(_finite_codes(kv_dtype, kv.shape, torch.Generator().manual_seed(seed)).to(self.device))
        if scale_granularity == "token_head":
            s = guarded(2 * num_blocks * block_size * num_kv_heads, torch.float32, self.device, self.world,
                        f"{label}.scales").view(2, num_blocks, block_size, num_kv_heads).fill_(1.0)
            scales = {"k_scale": s[0], "v_scale": s[1]}
        cache = KVCache.from_tensors(kv.view(fmt.torch_dtype), kv_dim=0, layout=layout,
                                     scale_granularity=scale_granularity, **scales)
        self.world.track_cache(cache, label)
        self.world.accept()
        return Tracked(cache, label)

    # -- the invariant ----------------------------------------------------------------------------
    def call(self, case: Case, op: str, fn: Callable[[], Any], *, what: str = "",
             effect: Callable[[Mirror, Any], None] | None = None, inputs: tuple = ()) -> Any:
        """Run ``fn()`` expecting ``case``: on success ``effect(mirror, result)`` plays the reference on a
        copy of the tracked storages, which must then equal them byte for byte; ``inputs`` must not change."""
        self.calls += 1
        self.world.accept()  # what the fuzzer set up since the last call
        what = f"{op}{' ' + what if what else ''} [{case.kind}: {case.family}]"
        if self.log is not None:
            self.log(what)
        before = [t.clone() for t in inputs if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        try:
            result = fn()
        except BackendFailure as exc:
            raise FuzzFailure(f"{what}: a backend failed instead of the call being served or refused: {exc}") \
                from exc
        except Fp8KVError as exc:
            self.world.verify(None, f"{what} (refused: {exc})")
            if case.kind == VALID and not isinstance(exc, Unsupported):
                raise FuzzFailure(f"{what}: a valid call was refused: {type(exc).__name__}: {exc}") from exc
            if case.kind == REFUSE and self.config.check_names and case.names and not isinstance(exc, Unsupported) \
                    and not any(n in str(exc) for n in case.names):
                raise FuzzFailure(f"{what}: refused, but the message names none of {case.names}: {exc}") from exc
            STATS.add(op, "unsupported" if isinstance(exc, Unsupported) else "refused", case.family)
            return None
        except Exception as exc:
            raise FuzzFailure(f"{what}: raised {type(exc).__name__} ({exc}); only fp8kv.Fp8KVError may be raised") \
                from exc
        if case.kind == REFUSE:
            raise FuzzFailure(f"{what}: accepted an invalid input (expected an fp8kv.Fp8KVError naming one of "
                              f"{case.names})")
        expected = self.world.expected()
        if effect is not None:
            effect(expected, result)
        self.world.verify(expected, what)
        after = [t for t in inputs if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        for a, b in zip(before, after, strict=True):
            if not torch.equal(as_bits(a), as_bits(b)):
                raise FuzzFailure(f"{what}: an input tensor was modified")
        STATS.add(op, "ok", case.family)
        return result

    # -- caches -----------------------------------------------------------------------------------
    def build(self, case: Case, fn: Callable[[], KVCache], label: str, *, what: str = "") -> Tracked | None:
        """Build a cache (``allocate``, ``from_tensors``, the constructor, ``replace``...); nothing may change."""
        cache = self.call(case, "build", fn, what=what)
        if cache is None:
            return None
        if not isinstance(cache, KVCache):
            raise FuzzFailure(f"build {what}: returned {type(cache).__name__}, not a KVCache")
        self.world.track_cache(cache, label)
        return Tracked(cache, label)

    def derive(self, case: Case, op: str, fn: Callable[[], KVCache], source: Tracked, label: str, *,
               what: str = "") -> Tracked | None:
        """A cache made from another (``slice_heads``, ``clone``, ``to``): nothing may change; same codes."""
        cache = self.call(case + source.case(f"cache.{op.removeprefix('dataclasses.')}"), op, fn, what=what)
        if cache is None:
            return None
        self.world.track_cache(cache, label)
        return Tracked(cache, label, source.broken, source.suspect)

    def copy_into(self, case: Case, dst: Tracked, src: Tracked, *, what: str = "") -> None:
        """``dst.cache.copy_(src.cache)``: ``dst``'s tensors get ``src``'s bytes, nothing else changes."""
        def effect(m: Mirror, result) -> None:
            if result is not dst.cache:
                raise FuzzFailure(f"copy_ {what}: did not return the destination cache")
            srcs = [m.tensor(getattr(src.cache, n)).clone() for n in ("key_cache", "value_cache", "k_scale", "v_scale")]
            for name, s in zip(("key_cache", "value_cache", "k_scale", "v_scale"), srcs, strict=True):
                as_bits(m.tensor(getattr(dst.cache, name))).copy_(as_bits(s))

        self.call(case + dst.case("cache.copy_") + src.case("cache.copy_"), "copy_", lambda: dst.cache.copy_(src.cache),
                  what=what, effect=effect)

    # -- steps ------------------------------------------------------------------------------------
    def plan(self, case: Case, cache: Any, *, what: str = "", **kwargs) -> AttentionMetadata | None:
        """``plan_attention``: refusals change nothing; a plan never touches the cache."""
        meta = self.call(case, "plan_attention", lambda: plan_attention(cache, **kwargs), what=what,
                         inputs=tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor)))
        if meta is not None and not isinstance(meta, AttentionMetadata):
            raise FuzzFailure(f"plan_attention {what}: returned {type(meta).__name__}")
        return meta

    def write(self, case: Case, target: Tracked, key, value, meta, *, what: str = "") -> None:
        """``write_kv`` with a plan: the tracked bytes must become what the reference writes."""
        slots = meta.slot_mapping if isinstance(meta, AttentionMetadata) else None

        def effect(m: Mirror, _) -> None:
            reference.write_kv(m.cache(target.cache), key.detach(), value.detach(), slots)

        self.call(case + target.case(), "write_kv", lambda: write_kv(target.cache, key, value, meta), what=what,
                  effect=effect, inputs=(key, value))

    def write_one_shot(self, case: Case, target: Tracked, key, value, slot_mapping, backend: str, *,
                       what: str = "") -> None:
        """``write_kv_one_shot``: as :meth:`write`."""
        def effect(m: Mirror, _) -> None:
            reference.write_kv(m.cache(target.cache), key.detach(), value.detach(), slot_mapping)

        self.call(case + target.case(), "write_kv_one_shot",
                  lambda: write_kv_one_shot(target.cache, key, value, slot_mapping, backend=backend), what=what,
                  effect=effect, inputs=(key, value, slot_mapping))

    def attend(self, case: Case, target: Tracked, query, meta, *, out=None, return_lse: bool = False,
               layer_scales: dict | None = None, what: str = "") -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``paged_attention`` with a plan: output (and lse) within the derived tolerance of the reference's;
        nothing but ``out`` changes."""
        return self._attention(case + target.case(), "paged_attention", target, query, meta, out, return_lse,
                               lambda: paged_attention(query, target.cache, meta, out=out, return_lse=return_lse,
                                                       layer_scales=layer_scales),
                               layer_scales, what)

    def attend_one_shot(self, case: Case, target: Tracked, query, block_tables, seq_lens, *, out=None,
                        return_lse: bool = False, what: str = "", **step) -> tuple | None:
        """``paged_attention_one_shot``: as :meth:`attend`; the reference plans the same step itself."""
        def meta_of():
            return plan_attention(target.cache, block_tables=block_tables, seq_lens=seq_lens,
                                  num_q_heads=query.shape[1], query_dtype=query.dtype, num_tokens=query.shape[0],
                                  **{**step, "backend": "reference"})

        return self._attention(case + target.case(), "paged_attention_one_shot", target, query, meta_of, out,
                               return_lse,
                               lambda: paged_attention_one_shot(query, target.cache, block_tables, seq_lens, out=out,
                                                                return_lse=return_lse, **step),
                               None, what, inputs=(block_tables, seq_lens, *step.values()))

    def _attention(self, case, op, target, query, meta, out, return_lse, fn, layer_scales, what, inputs=()):
        def effect(m: Mirror, result) -> None:
            if isinstance(out, torch.Tensor) and _key(out) in m.bytes:
                as_bits(m.tensor(out)).copy_(as_bits(out))

        result = self.call(case, op, fn, what=what, effect=effect, inputs=(query, *inputs))
        if result is None:
            return None
        got, lse = (result if return_lse else (result, None))
        if return_lse and not (isinstance(result, tuple) and len(result) == 2):
            raise FuzzFailure(f"{op} {what}: return_lse=True returned {type(result).__name__}, not (out, lse)")
        if out is not None and got is not out:
            raise FuzzFailure(f"{op} {what}: did not return the given out tensor")
        if got.shape != query.shape or got.dtype != query.dtype or got.requires_grad:
            raise FuzzFailure(f"{op} {what}: output {got.dtype} {tuple(got.shape)} (requires_grad="
                              f"{got.requires_grad}), expected {query.dtype} {tuple(query.shape)} without grad")
        if lse is not None and (lse.dtype != torch.float32 or lse.shape != query.shape[:2]):
            raise FuzzFailure(f"{op} {what}: lse {lse.dtype} {tuple(lse.shape)}, expected float32 "
                              f"{tuple(query.shape[:2])}")
        if case.kind in (VALID, EITHER):
            if callable(meta):
                meta = meta()
            if layer_scales:
                opts = dataclasses.replace(meta.options, **layer_scales)
                meta = dataclasses.replace(meta, options=opts)
            checked = check_attention_values(query.detach(), target.cache, meta, got, lse,
                                             what=f"{op} {what} [{case.kind}: {case.family}]")
            STATS.add(op, "values compared" if checked else "values skipped (non-finite)")
        return got, lse

    def merge(self, case: Case, out_a, lse_a, out_b, lse_b, *, what: str = "") -> None:
        """``merge_attention_states``: within :func:`merge_tolerance` of its float64 formula."""
        result = self.call(case, "merge_attention_states", lambda: merge_attention_states(out_a, lse_a, out_b, lse_b),
                           what=what, inputs=(out_a, lse_a, out_b, lse_b))
        if result is None:
            return
        out, lse = result
        if out.dtype != out_a.dtype or out.shape != out_a.shape or lse.dtype != torch.float32:
            raise FuzzFailure(f"merge_attention_states {what}: returned {out.dtype} {tuple(out.shape)} / {lse.dtype}")
        ref, ref_lse = merge_reference(out_a, lse_a, out_b, lse_b)
        tol, lse_tol = merge_tolerance(out_a, out_b, ref, ref_lse)
        if not _close(out, ref, tol):
            raise FuzzFailure(f"merge_attention_states {what}: output beyond the derived tolerance of the formula")
        if not _close(lse, ref_lse, lse_tol):
            raise FuzzFailure(f"merge_attention_states {what}: lse beyond the derived tolerance of the formula")


# ------------------------------------------------------------------------------------------- drawing


class Draw:
    """Small draws from Hypothesis' ``st.data()`` (choices shrink toward the first option, chances toward no)."""

    def __init__(self, data) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def pick(self, options):
        return self.data.draw(st.sampled_from(tuple(options)))

    def chance(self, p: float) -> bool:
        return self.data.draw(st.integers(0, 99)) >= 100 - round(100 * p)

    def seed(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.data.draw(st.integers(0, 2**31 - 1)))

    def permutation(self, n: int) -> list[int]:
        return list(self.data.draw(st.permutations(range(n))))


SCALES = (1.0, 0.5, 0.05, 0.013, 2.0**-7, 3.7, 100.0, 1e-20, 1e20)
BAD_SCALES = (0.0, -1.0, math.nan, math.inf, 1e39)


@dataclass
class Step:
    """A drawn step: the keywords of :func:`fp8kv.plan_attention` (besides the cache and the backend),
    and what they mean."""

    kw: dict
    num_q_heads: int
    query_dtype: torch.dtype
    seq_lens: list[int]
    q_lens: list[int]
    rows: list[list[int]]
    pages: list[int]
    csr: bool
    decode: bool
    checked: bool
    case: Case = OK

    @property
    def num_tokens(self) -> int:
        return len(self.seq_lens) if self.decode else sum(self.q_lens)


def draw_step(d: Draw, spec, cfg: FuzzConfig, *, csr: bool = True, slots: bool = True) -> Step:
    """A valid step over ``spec`` (padded or CSR table, decode or prefill, options, maybe slots)."""
    nb, bs, H, dev = spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.device
    S = 0 if d.chance(0.08) else d.int(1, cfg.max_seqs)
    decode = d.chance(0.5)
    cols = d.int(1 if decode else 0, cfg.max_table_cols)
    seq_lens = [d.int(1 if decode else 0, cols * bs) for _ in range(S)]
    q_lens = [1] * S if decode else [d.int(0, n) for n in seq_lens]
    pages = [-(-n // bs) for n in seq_lens]
    perm = d.permutation(nb)
    case = OK
    fill = d.pick((0, -1, nb + 7))
    if fill == nb + 7:
        case = Case(VALID, "plan.unused_entries_garbage")
        if not cfg.drawn(case.family):
            fill, case = 0, OK
    rows, at = [], 0
    for p in pages:
        rows.append([perm[(at + j) % nb] for j in range(p)] + [fill] * (cols - p))
        at += p
    idx = d.pick((torch.int32, torch.int64))
    kw: dict[str, Any] = {}
    use_csr = csr and d.chance(0.3)
    if use_csr:
        indptr = [0]
        for p in pages:
            indptr.append(indptr[-1] + p)
        indices = [b for r, p in zip(rows, pages, strict=True) for b in r[:p]]
        tail = d.int(0, 2)
        if tail:
            garbage = Case(VALID, "plan.csr.indices_tail_garbage")
            if cfg.drawn(garbage.family) and d.chance(0.5):
                indices += [d.pick((-1, nb, 2**20)) for _ in range(tail)]
                case = case + garbage
            else:
                indices += [d.int(0, nb - 1) for _ in range(tail)]
        last = [n - (p - 1) * bs if p else d.int(0, bs) for n, p in zip(seq_lens, pages, strict=True)]
        kw.update(kv_indptr=torch.tensor(indptr, dtype=idx, device=dev),
                  kv_indices=torch.tensor(indices, dtype=idx, device=dev),
                  kv_last_page_len=torch.tensor(last, dtype=idx, device=dev))
        if d.chance(0.3):
            kw["max_blocks"] = max(pages, default=0) + d.int(0, 1)
    else:
        kw.update(block_tables=torch.tensor(rows, dtype=idx, device=dev).reshape(S, cols),
                  seq_lens=torch.tensor(seq_lens, dtype=idx, device=dev))
    T = S if decode else sum(q_lens)
    if not decode:
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        kw["query_start_loc"] = torch.tensor(qsl, dtype=idx, device=dev)
        if d.chance(0.2):
            kw["host_query_start_loc"] = qsl
        if d.chance(0.5):
            kw["max_query_len"] = max(q_lens, default=0) + d.int(0, 1)
    if d.chance(0.5):
        kw["num_tokens"] = T
    if d.chance(0.3):
        kw["max_seq_len"] = max(seq_lens, default=0) + d.int(0, 2)
    if d.chance(0.2):
        kw["host_seq_lens"] = list(seq_lens)
    if slots and d.chance(0.7):
        seen: set[int] = set()
        mapping = []
        for r, n, q in zip(rows, seq_lens, q_lens, strict=True):
            for p in range(n - q, n):
                s = r[p // bs] * bs + p % bs
                mapping.append(-1 if s in seen else s)
                seen.add(s)
        mapping += [d.pick((-1, -7)) for _ in range(d.int(0, 2))]
        kw["slot_mapping"] = torch.tensor(mapping, dtype=d.pick((torch.int64, torch.int32)), device=dev)
    _draw_options(d, kw, spec, cfg, cols * bs)
    Hq = H * d.pick(cfg.gqa_ratios)
    if kw.get("fp8_attention") and d.chance(0.5):
        kw["q_scale"] = torch.full(d.pick(((), (H,), (Hq,))), d.pick((0.01, 1.0, 2.0**-6)), device=dev)
    checked = not d.chance(cfg.unchecked)
    kw["validate"] = d.pick((None, True)) if checked else False
    checked = values_checked(dev, kw["validate"])
    return Step(kw, Hq, d.pick(cfg.io_dtypes), seq_lens, q_lens, rows, pages, use_csr, decode, checked, case)


def fp8_servable(spec) -> bool:
    """Whether the FP8 attention mode is defined for caches of ``spec``."""
    return spec.kv_dtype == "fp8_e4m3" and spec.scale_granularity in ("tensor", "head")


def _draw_options(d: Draw, kw: dict, spec, cfg: FuzzConfig, cap: int) -> None:
    if d.chance(0.2):
        kw["causal"] = False
    how = d.int(0, 3)
    if how == 2:
        kw["sliding_window"] = d.int(1, cap + 2)
    elif how == 3:
        kw["window_left"] = d.int(-1, cap + 1)
    if d.chance(0.25):
        kw["logits_soft_cap"] = d.pick((0.5, 5.0, 30.0))
    if d.chance(0.3):
        kw["softmax_scale"] = d.pick((0.05, 0.3, 1.7))
    if cfg.fp8_attention and fp8_servable(spec) and d.chance(0.25):
        kw["fp8_attention"] = True
        if d.chance(0.5):
            kw["prob_scale"] = d.pick((1.0, 0.25, 1 / 448))


VALUE_FAMILIES = frozenset({
    "plan.seq_lens.negative", "plan.seq_lens.past_table", "plan.seq_lens.below_queries",
    "plan.block_tables.out_of_range",
    "plan.query_start_loc.first", "plan.query_start_loc.decreasing", "plan.query_start_loc.last",
    "plan.slot_mapping.out_of_range", "plan.csr.indptr_first", "plan.csr.indptr_past", "plan.csr.last_page_len",
    "plan.csr.indices_out_of_range", "plan.csr.max_blocks_small", "plan.max_query_len.small", "plan.max_seq_len.small",
    "plan.host_seq_lens.values", "plan.host_query_start_loc.values",
})
"""Mutations of values (not shapes or types): refused when the host checks run, garbage with the reference's
meaning (or, for bounds the kernels rely on, any output) when they do not."""


def _value(step: Step, family: str, names: tuple[str, ...], unchecked: str = EITHER) -> Case:
    """A value the host checks refuse; with them off, garbage the reference gives a meaning to."""
    return Case(REFUSE, family, names) if step.checked else Case(unchecked, family)


def _int64(step: Step, name: str) -> bool:
    return step.kw[name].dtype == torch.int64


def _set(step: Step, name: str, i: int, v: int) -> None:
    t = step.kw[name].clone()
    t[i] = v
    step.kw[name] = t


def _step_mutations(step: Step, spec, cfg: FuzzConfig, *, one_shot: bool) -> list[tuple[str, Callable]]:
    """The invalid variations of ``step`` that apply: (family, apply(draw) -> Case)."""
    kw, S, bs, nb, H = step.kw, len(step.seq_lens), spec.block_size, spec.num_blocks, spec.num_kv_heads
    padded, prefill, T = not step.csr, not step.decode, step.num_tokens
    m: list[tuple[str, Callable]] = []

    def add(family: str, when: bool = True):
        def deco(fn):
            if when and cfg.drawn(family):
                m.append((family, fn))
            return fn
        return deco

    def refuse(family, *names):
        return Case(REFUSE, family, names)

    def lengths_changed():  # padded tables only: the bound and the host copy follow the new lengths
        kw.pop("max_seq_len", None)
        if "host_seq_lens" in kw:
            kw["host_seq_lens"] = kw["seq_lens"].tolist()

    # -- shapes, types and devices: refused whatever the checks
    @add("plan.block_tables.dtype", padded)
    def _(d):
        kw["block_tables"] = kw["block_tables"].float()
        return refuse("plan.block_tables.dtype", "block_tables")

    @add("plan.block_tables.ndim", padded)
    def _(d):
        kw["block_tables"] = kw["block_tables"].reshape(-1)
        return refuse("plan.block_tables.ndim", "block_tables")

    @add("plan.block_tables.rows", padded)
    def _(d):
        bt = kw["block_tables"]
        kw["block_tables"] = torch.cat([bt, torch.zeros(1, bt.shape[1], dtype=bt.dtype, device=bt.device)])
        return refuse("plan.block_tables.rows", "block_tables", "seq_lens")

    @add("plan.block_tables.type", padded)
    def _(d):
        kw["block_tables"] = kw["block_tables"].tolist()
        return refuse("plan.block_tables.type", "block_tables")

    @add("plan.seq_lens.dtype", padded)
    def _(d):
        kw["seq_lens"] = kw["seq_lens"].to(d.pick((torch.float32, torch.int16)))
        return refuse("plan.seq_lens.dtype", "seq_lens")

    @add("plan.seq_lens.ndim", padded)
    def _(d):
        kw["seq_lens"] = kw["seq_lens"][:, None]
        return refuse("plan.seq_lens.ndim", "seq_lens")

    @add("plan.query_start_loc.entries", prefill)
    def _(d):
        kw["query_start_loc"] = kw["query_start_loc"][:-1]
        kw.pop("host_query_start_loc", None)
        return refuse("plan.query_start_loc.entries", "query_start_loc")

    @add("plan.query_start_loc.dtype", prefill)
    def _(d):
        kw["query_start_loc"] = kw["query_start_loc"].float()
        return refuse("plan.query_start_loc.dtype", "query_start_loc")

    @add("plan.slot_mapping.dtype", "slot_mapping" in kw)
    def _(d):
        kw["slot_mapping"] = kw["slot_mapping"].to(d.pick((torch.float32, torch.int16)))
        return refuse("plan.slot_mapping.dtype", "slot_mapping")

    @add("plan.slot_mapping.ndim", "slot_mapping" in kw)
    def _(d):
        kw["slot_mapping"] = kw["slot_mapping"][:, None]
        return refuse("plan.slot_mapping.ndim", "slot_mapping")

    @add("plan.index.device", spec.device.type != "meta")
    def _(d):
        name = d.pick(sorted(k for k, v in kw.items() if isinstance(v, torch.Tensor) and k != "q_scale"))
        kw[name] = kw[name].to("meta")
        return refuse("plan.index.device", name)

    @add("plan.both_forms", not one_shot)
    def _(d):
        if step.csr:
            kw.update(block_tables=torch.zeros(S, 1, dtype=torch.int32, device=spec.device),
                      seq_lens=torch.zeros(S, dtype=torch.int32, device=spec.device))
        else:
            kw.update(kv_indptr=torch.zeros(S + 1, dtype=torch.int32, device=spec.device))
        return refuse("plan.both_forms", "block_tables")

    @add("plan.csr.indptr_entries", step.csr)
    def _(d):
        kw["kv_indptr"] = kw["kv_indptr"][:-1]
        return refuse("plan.csr.indptr_entries", "kv_indptr")

    @add("plan.csr.missing", step.csr)
    def _(d):
        del kw["kv_last_page_len"]
        return refuse("plan.csr.missing", "kv_last_page_len")

    @add("plan.num_q_heads", not one_shot)
    def _(d):
        bad = d.pick((0, -H, True, 2.5) + ((H + 1,) if H > 1 else ()))
        return refuse("plan.num_q_heads", "num_q_heads"), {"num_q_heads": bad}

    @add("plan.query_dtype", not one_shot)
    def _(d):
        bad = d.pick((torch.float64, torch.int32, "float16", torch.float8_e4m3fn))
        return refuse("plan.query_dtype", "query_dtype"), {"query_dtype": bad}

    @add("plan.softmax_scale")
    def _(d):
        kw["softmax_scale"] = d.pick((0.0, -1.0, math.nan, math.inf, "0.5", True, 1e39))
        return refuse("plan.softmax_scale", "softmax_scale")

    @add("plan.causal")
    def _(d):
        kw["causal"] = d.pick((1, "yes", None))
        return refuse("plan.causal", "causal")

    @add("plan.sliding_window")
    def _(d):
        kw.pop("window_left", None)
        kw["sliding_window"] = d.pick((0, -3, 2.5, True))
        return refuse("plan.sliding_window", "sliding_window")

    @add("plan.window_left")
    def _(d):
        kw.pop("sliding_window", None)
        kw["window_left"] = d.pick((-2, 1.5, True))
        return refuse("plan.window_left", "window_left")

    @add("plan.window_both")
    def _(d):
        kw.update(sliding_window=2, window_left=1)
        return refuse("plan.window_both", "window_left")

    @add("plan.logits_soft_cap")
    def _(d):
        kw["logits_soft_cap"] = d.pick((0.0, -1.0, math.nan, math.inf, "1"))
        return refuse("plan.logits_soft_cap", "logits_soft_cap")

    @add("plan.fp8.cache", not fp8_servable(spec))
    def _(d):
        kw["fp8_attention"] = True
        return refuse("plan.fp8.cache", "fp8_attention")

    @add("plan.fp8.flag")
    def _(d):
        kw["fp8_attention"] = d.pick((1, "yes"))
        return refuse("plan.fp8.flag", "fp8_attention")

    @add("plan.q_scale.without_fp8", not kw.get("fp8_attention"))
    def _(d):
        kw["q_scale"] = torch.ones((), device=spec.device)
        return refuse("plan.q_scale.without_fp8", "q_scale")

    @add("plan.q_scale.bad", bool(kw.get("fp8_attention")))
    def _(d):
        dev = spec.device
        kw["q_scale"] = d.pick((torch.zeros((), device=dev), torch.full((), -1.0, device=dev),
                                torch.full((), math.nan, device=dev), torch.ones(step.num_q_heads + 1, device=dev),
                                torch.ones((), dtype=torch.float64, device=dev), 1.0))
        return refuse("plan.q_scale.bad", "q_scale")

    @add("plan.prob_scale")
    def _(d):
        kw["prob_scale"] = d.pick((0.0, math.nan, -1.0, "x", math.inf)) if kw.get("fp8_attention") else 2.0
        return refuse("plan.prob_scale", "prob_scale")

    @add("plan.num_tokens.decode", step.decode and not one_shot)
    def _(d):
        kw["num_tokens"] = S + 1
        return refuse("plan.num_tokens.decode", "num_tokens")

    @add("plan.num_tokens.type", not one_shot)
    def _(d):
        kw["num_tokens"] = d.pick((-1, True, 1.5))
        return refuse("plan.num_tokens.type", "num_tokens")

    @add("plan.max_query_len.type")
    def _(d):
        kw["max_query_len"] = d.pick((-1, True))
        return refuse("plan.max_query_len.type", "max_query_len")

    @add("plan.max_query_len.decode_zero", step.decode and S > 0)
    def _(d):
        kw["max_query_len"] = 0
        return refuse("plan.max_query_len.decode_zero", "max_query_len")

    @add("plan.max_seq_len.type")
    def _(d):
        kw["max_seq_len"] = d.pick((-2, 1.0))
        return refuse("plan.max_seq_len.type", "max_seq_len")

    @add("plan.max_blocks.type", step.csr)
    def _(d):
        kw["max_blocks"] = d.pick((-1, True))
        return refuse("plan.max_blocks.type", "max_blocks")

    @add("plan.backend")
    def _(d):
        return refuse("plan.backend", "backend"), {"backend": d.pick(("nope", 3, None))}

    @add("plan.cache", not one_shot)
    def _(d):
        return refuse("plan.cache", "cache"), {"cache": d.pick((torch.zeros(1), None, "cache"))}

    @add("plan.host_seq_lens.length")
    def _(d):
        kw["host_seq_lens"] = [*step.seq_lens, 1]
        return refuse("plan.host_seq_lens.length", "host_seq_lens")

    @add("plan.host_seq_lens.type", S > 0)
    def _(d):
        kw["host_seq_lens"] = d.pick(([1.5] * S, "a" * S, 3))
        return refuse("plan.host_seq_lens.type", "host_seq_lens")

    @add("plan.host_query_start_loc.length", prefill)
    def _(d):
        kw["host_query_start_loc"] = [0] * (S + 2)
        return refuse("plan.host_query_start_loc.length", "host_query_start_loc")

    # -- values: refused when checked; otherwise garbage the reference gives a meaning to
    @add("plan.seq_lens.negative", padded and S > 0)
    def _(d):
        _set(step, "seq_lens", d.int(0, S - 1), d.pick((-1, -100)))
        lengths_changed()
        return _value(step, "plan.seq_lens.negative", ("seq_lens",))

    @add("plan.seq_lens.past_table", padded and S > 0)
    def _(d):
        _set(step, "seq_lens", d.int(0, S - 1), kw["block_tables"].shape[1] * bs + d.int(1, 3))
        lengths_changed()
        return _value(step, "plan.seq_lens.past_table", ("seq_lens",))

    @add("plan.seq_lens.below_queries", padded and any(q > 0 for q in step.q_lens))
    def _(d):
        i = d.pick([i for i, q in enumerate(step.q_lens) if q > 0])
        _set(step, "seq_lens", i, step.q_lens[i] - 1)
        lengths_changed()
        return _value(step, "plan.seq_lens.below_queries", ("seq_lens",))

    used = [(i, j) for i, p in enumerate(step.pages) for j in range(p)]

    @add("plan.block_tables.out_of_range", padded and bool(used))
    def _(d):
        i, j = d.pick(used)
        bt = kw["block_tables"].clone()
        bt[i, j] = d.pick((nb, -1, 2**31 - 1) + ((2**40,) if bt.dtype == torch.int64 else ()))
        kw["block_tables"] = bt
        return _value(step, "plan.block_tables.out_of_range", ("block_tables", "index tensors"))

    @add("plan.query_start_loc.first", prefill)
    def _(d):
        _set(step, "query_start_loc", 0, 1)
        kw.pop("max_query_len", None)
        kw.pop("host_query_start_loc", None)
        return _value(step, "plan.query_start_loc.first", ("query_start_loc",))

    @add("plan.query_start_loc.decreasing", prefill and S >= 2)
    def _(d):
        _set(step, "query_start_loc", 1, int(kw["query_start_loc"][2]) + 1)
        kw.pop("max_query_len", None)
        kw.pop("host_query_start_loc", None)
        return _value(step, "plan.query_start_loc.decreasing", ("query_start_loc",))

    @add("plan.query_start_loc.last", prefill and "num_tokens" in kw and not one_shot)
    def _(d):
        _set(step, "query_start_loc", S, T + 1)
        kw.pop("max_query_len", None)
        kw.pop("host_query_start_loc", None)
        return _value(step, "plan.query_start_loc.last", ("query_start_loc", "num_tokens"))

    n_slots = kw["slot_mapping"].shape[0] if "slot_mapping" in kw else 0

    @add("plan.slot_mapping.out_of_range", n_slots > 0)
    def _(d):
        big = (2**40,) if _int64(step, "slot_mapping") else (2**31 - 1,)
        _set(step, "slot_mapping", d.int(0, n_slots - 1), d.pick((spec.num_slots, spec.num_slots + bs) + big))
        return _value(step, "plan.slot_mapping.out_of_range", ("slot_mapping", "index tensors"))

    valid_slots = [i for i, s in enumerate(kw["slot_mapping"].tolist()) if s >= 0] if n_slots else []

    @add("plan.slot_mapping.duplicate", step.checked and valid_slots and n_slots >= 2)
    def _(d):
        i = d.pick(valid_slots)
        j = d.pick([j for j in range(n_slots) if j != i])
        _set(step, "slot_mapping", j, int(kw["slot_mapping"][i]))
        return refuse("plan.slot_mapping.duplicate", "slot_mapping")

    @add("plan.csr.indptr_first", step.csr)
    def _(d):
        _set(step, "kv_indptr", 0, 1)
        kw.pop("max_seq_len", None)
        kw.pop("host_seq_lens", None)
        return _value(step, "plan.csr.indptr_first", ("kv_indptr",))

    @add("plan.csr.indptr_past", step.csr and S > 0)
    def _(d):
        _set(step, "kv_indptr", S, kw["kv_indices"].shape[0] + 1)
        kw.pop("max_seq_len", None)
        kw.pop("max_blocks", None)
        kw.pop("host_seq_lens", None)
        return _value(step, "plan.csr.indptr_past", ("kv_indptr",))

    with_pages = [i for i, p in enumerate(step.pages) if p > 0]

    @add("plan.csr.last_page_len", step.csr and bool(with_pages))
    def _(d):
        _set(step, "kv_last_page_len", d.pick(with_pages), d.pick((0, bs + 1)))
        kw.pop("max_seq_len", None)
        kw.pop("host_seq_lens", None)
        return _value(step, "plan.csr.last_page_len", ("kv_last_page_len",))

    @add("plan.csr.indices_out_of_range", step.csr and bool(used))
    def _(d):
        _set(step, "kv_indices", d.int(0, len(used) - 1), d.pick((nb, -1)))
        return _value(step, "plan.csr.indices_out_of_range", ("kv_indices",))

    @add("plan.csr.max_blocks_small", step.csr and max(step.pages, default=0) > 0)
    def _(d):
        kw["max_blocks"] = max(step.pages) - 1
        kw.pop("max_seq_len", None)
        return _value(step, "plan.csr.max_blocks_small", ("max_blocks",))

    @add("plan.max_query_len.small", prefill and max(step.q_lens, default=0) > 0)
    def _(d):
        kw["max_query_len"] = max(step.q_lens) - 1
        return _value(step, "plan.max_query_len.small", ("max_query_len",), MEMORY)

    @add("plan.max_seq_len.small", max(step.seq_lens, default=0) > 0)
    def _(d):
        kw["max_seq_len"] = max(step.seq_lens) - 1
        return _value(step, "plan.max_seq_len.small", ("max_seq_len",), MEMORY)

    @add("plan.host_seq_lens.values", S > 0)
    def _(d):
        kw["host_seq_lens"] = [n + (k == 0) for k, n in enumerate(step.seq_lens)]
        return _value(step, "plan.host_seq_lens.values", ("host_seq_lens",))

    @add("plan.host_query_start_loc.values", prefill and S > 0)
    def _(d):
        qsl = kw["query_start_loc"].tolist()
        kw["host_query_start_loc"] = qsl[:-1] + [qsl[-1] + 1]
        return _value(step, "plan.host_query_start_loc.values", ("host_query_start_loc",))

    return m


def mutate_step(d: Draw, step: Step, spec, cfg: FuzzConfig, *, one_shot: bool = False) -> tuple[Case, dict]:
    """Maybe make ``step`` invalid (in place): the case, and overrides of the call's other arguments."""
    options = _step_mutations(step, spec, cfg, one_shot=one_shot)
    garbage = [(f, fn) for f, fn in options if f in VALUE_FAMILIES]
    if not step.checked and garbage and d.chance(0.6):  # checks off: mostly hostile values
        options = garbage
    elif not options or not d.chance(cfg.invalid):
        return step.case, {}
    family, apply = options[d.int(0, len(options) - 1)]
    got = apply(d)
    case, overrides = got if isinstance(got, tuple) else (got, {})
    return step.case + case, overrides


# ------------------------------------------------------------------------------------------- caches


def _strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def draw_scales(d: Draw, h: Harness, gran: str, H: int, nb: int, bs: int, label: str, *, given: bool = False) -> dict:
    """Scales for a cache of granularity ``gran``: numbers, float32/float64 tensors, guarded float32
    views; token_head: None (allocated), or the engine's tensors (one ``[2, ...]`` region, or two).
    ``given``: always tensors of the exact shape (the constructor's)."""
    dev = h.device
    if gran == "token_head":
        how = d.pick(("pair", "separate") if given else ("allocated", "pair", "separate"))
        if how == "allocated":
            return {}
        g = d.seed()
        n = nb * bs * H
        if how == "pair":
            r = guarded(2 * n, torch.float32, dev, h.world, f"{label}.scales").view(2, nb, bs, H)
            r.copy_((torch.rand(2, nb, bs, H, generator=g) * 2 + 0.01).to(dev))
            return {"k_scale": r[0], "v_scale": r[1]}
        out = {}
        for name in ("k_scale", "v_scale"):
            r = guarded(n, torch.float32, dev, h.world, f"{label}.{name}").view(nb, bs, H)
            r.copy_((torch.rand(nb, bs, H, generator=g) * 2 + 0.01).to(dev))
            out[name] = r
        return out
    shape = () if gran == "tensor" else (H,)
    out = {}
    for name in ("k_scale", "v_scale"):
        vals = torch.tensor([d.pick(SCALES) for _ in range(1 if gran == "tensor" else H)]).reshape(shape)
        form = d.pick(("tensor", "guarded") if given else ("default", "float", "tensor", "float64", "guarded"))
        if form == "default":
            continue
        if form == "float":
            out[name] = float(vals.flatten()[0])
        elif form == "tensor":
            out[name] = vals.to(torch.float32).to(dev)
        elif form == "float64":
            out[name] = vals.to(torch.float64)
        else:
            r = guarded(max(1, vals.numel()), torch.float32, dev, h.world, f"{label}.{name}").reshape(shape)
            r.copy_(vals.to(dev))
            out[name] = r
    return out


@dataclass
class CacheDraw:
    """A drawn cache build: the call, its expected case, what it is, and what the cache must look like."""

    build: Callable[[], KVCache]
    case: Case
    what: str
    geometry: tuple
    tensors: tuple = ()
    fill: Callable[[KVCache], None] | None = None


def draw_cache(d: Draw, h: Harness, cfg: FuzzConfig, label: str, *, mutate: bool = True) -> CacheDraw:
    """A cache build through ``allocate``, ``from_tensors`` (engine-style views into guarded buffers) or
    the constructor, maybe with an invalid argument."""
    dev = h.device
    kv_dtype, layout, gran = d.pick(cfg.kv_dtypes), d.pick(cfg.layouts), d.pick(cfg.granularities)
    fmt = FORMATS[kv_dtype]
    nb, bs, H, D = d.int(1, cfg.max_blocks), d.pick(cfg.block_sizes), d.pick(cfg.kv_heads), d.pick(cfg.head_sizes)
    shape = (nb, bs, H, D) if layout == "NHD" else (nb, H, bs, D)
    inner = bs * H * D
    g = d.seed()
    variant = d.pick(("pair", "pages", "padded", "permuted", "allocate", "constructor"))
    uint8 = variant not in ("allocate", "constructor") and d.chance(0.3)
    dtype = torch.uint8 if uint8 else fmt.torch_dtype
    geometry = (kv_dtype, layout, gran, nb, bs, H, D)
    what = f"{variant} {kv_dtype} {layout} {gran} nb={nb} bs={bs} H={H} D={D}{' uint8' if uint8 else ''}"

    def region(numel: int, name: str) -> torch.Tensor:
        return guarded(numel, torch.uint8, dev, h.world, f"{label}.{name}").view(dtype)

    def fill(t: torch.Tensor) -> None:
        t.view(torch.uint8).copy_(_finite_codes(kv_dtype, t.shape, g).to(dev))

    kwargs: dict[str, Any] = {"layout": layout}
    if uint8 or d.chance(0.5):
        kwargs["kv_dtype"] = kv_dtype
    if gran != "tensor" or d.chance(0.5):
        kwargs["scale_granularity"] = gran
    args: list[Any]
    if variant in ("pair", "constructor"):
        t = region(2 * nb * inner, "kv").view(2, *shape)
        fill(t)
        args = [t]
        kwargs["kv_dim"] = d.pick((0, -5))
    elif variant == "pages":
        t = region(2 * nb * inner, "kv").view(nb, 2, *shape[1:])
        fill(t)
        args = [t]
        kwargs["kv_dim"] = d.pick((1, -4))
    elif variant == "padded":
        args = []
        for name in ("k", "v"):
            pitch = inner + d.int(0, D)
            t = region(nb * pitch, name).as_strided(shape, (pitch, *_strides(shape[1:])))
            fill(t)
            args.append(t)
    elif variant == "permuted":
        store = (nb, H, bs, D) if layout == "NHD" else (nb, bs, H, D)
        if d.chance(0.5):
            t = region(2 * nb * inner, "kv").view(2, *store).transpose(2, 3)
            args = [t[0], t[1]]
        else:
            args = [region(nb * inner, name).view(store).transpose(1, 2) for name in ("k", "v")]
        for t in args:
            fill(t)
    else:
        args = []
    scales = draw_scales(d, h, gran, H, nb, bs, label, given=variant == "constructor")
    kwargs.update(scales)
    options: list[tuple[str, Callable[[], Case]]] = []
    state: dict[str, Any] = {"variant": variant}

    def add(family: str, when: bool = True):
        def deco(fn):
            if when and cfg.drawn(family):
                options.append((family, fn))
            return fn
        return deco

    def separate() -> tuple[torch.Tensor, torch.Tensor]:
        if len(args) == 1:
            dim = kwargs.pop("kv_dim") % 5
            args[:] = [args[0].select(dim, 0), args[0].select(dim, 1)]
        return args[0], args[1]

    from_tensors = variant in ("pair", "pages", "padded", "permuted")
    static = gran != "token_head"

    @add("cache.dtype", from_tensors)
    def _():
        args[:] = [a.view(torch.uint8).to(torch.float16) for a in args]
        return Case(REFUSE, "cache.dtype", ("key_cache",))

    @add("cache.kv_dtype.missing", from_tensors and uint8)
    def _():
        kwargs.pop("kv_dtype", None)
        return Case(REFUSE, "cache.kv_dtype.missing", ("kv_dtype",))

    @add("cache.kv_dtype.other", from_tensors and not uint8)
    def _():
        kwargs["kv_dtype"] = d.pick([f for f in FORMATS if f != kv_dtype])
        return Case(REFUSE, "cache.kv_dtype.other", ("key_cache",))

    @add("cache.kv_dtype.unknown", from_tensors or variant == "allocate")
    def _():
        kwargs["kv_dtype"] = d.pick(("fp9", "float8", 3))
        return Case(REFUSE, "cache.kv_dtype.unknown", ("kv_dtype",))

    @add("cache.value.shape", from_tensors and (nb > 1 or D > 1))
    def _():
        k, v = separate()
        args[1] = v.narrow(0, 0, nb - 1) if nb > 1 else v.narrow(3, 0, D - 1)
        return Case(REFUSE, "cache.value.shape", ("value_cache",))

    @add("cache.value.aliases_key", from_tensors)
    def _():
        k, _ = separate()
        args[1] = k
        return Case(REFUSE, "cache.value.aliases_key", ("value_cache",))

    @add("cache.value.overlaps_key", from_tensors)
    def _():
        k, _ = separate()
        args[1] = k.as_strided(k.shape, k.stride(), k.storage_offset() + 1)
        return Case(REFUSE, "cache.value.overlaps_key", ("value_cache",))

    @add("cache.value.device", from_tensors and dev.type != "meta")
    def _():
        _, v = separate()
        args[1] = v.to("meta")
        return Case(REFUSE, "cache.value.device", ("value_cache",))

    @add("cache.key.last_stride", from_tensors and D > 1)
    def _():
        separate()
        wide = region(2 * nb * inner, "wide").view(*shape[:-1], 2 * D)
        args[0] = wide[..., ::2]
        return Case(REFUSE, "cache.key.last_stride", ("key_cache",))

    @add("cache.key.overlapping", from_tensors and nb > 1)
    def _():
        k, _ = separate()
        args[0] = k.as_strided(k.shape, (0, *k.stride()[1:]), k.storage_offset())
        return Case(REFUSE, "cache.key.overlapping", ("key_cache",))

    @add("cache.key.ndim", from_tensors)
    def _():
        k, _ = separate()
        args[0] = k.flatten(0, 1)
        return Case(REFUSE, "cache.key.ndim", ("key_cache",))

    @add("cache.kv_dim", from_tensors and len(args) == 1)
    def _():
        kwargs["kv_dim"] = d.pick([i for i in range(5) if args[0].shape[i] != 2] + [5, True, "1"])
        return Case(REFUSE, "cache.kv_dim", ("kv_dim", "key_cache"))

    @add("cache.empty", from_tensors)
    def _():
        k, v = separate()
        args[:] = [k.narrow(0, 0, 0), v.narrow(0, 0, 0)]
        return Case(REFUSE, "cache.empty", ("key_cache", "k_scale", "v_scale"))

    @add("cache.layout", variant != "constructor")
    def _():
        kwargs["layout"] = d.pick(("XYZ", "nhd", None))
        return Case(REFUSE, "cache.layout", ("layout",))

    @add("cache.granularity", variant != "constructor")
    def _():
        kwargs["scale_granularity"] = d.pick(("block", "", 3))
        return Case(REFUSE, "cache.granularity", ("scale_granularity",))

    @add("cache.scale.value", static and variant != "constructor")
    def _():
        name, bad = d.pick(("k_scale", "v_scale")), d.pick(BAD_SCALES)
        kwargs[name] = bad if d.chance(0.5) else torch.full(() if gran == "tensor" else (H,), bad, dtype=torch.float64)
        return Case(REFUSE, "cache.scale.value", (name,))

    @add("cache.scale.shape", static and variant != "constructor")
    def _():
        name = d.pick(("k_scale", "v_scale"))
        kwargs[name] = torch.ones(2 if gran == "tensor" else H + 1, device=dev)
        return Case(REFUSE, "cache.scale.shape", (name,))

    @add("cache.scale.type", variant != "constructor")
    def _():
        name = d.pick(("k_scale", "v_scale"))
        kwargs[name] = d.pick(("1.0", [1.0], True))
        return Case(REFUSE, "cache.scale.type", (name,))

    @add("cache.token_head.static", not static and variant != "constructor")
    def _():
        kwargs["k_scale"] = 0.5
        return Case(REFUSE, "cache.token_head.static", ("k_scale",))

    @add("cache.token_head.shape", not static and variant != "constructor")
    def _():
        name = d.pick(("k_scale", "v_scale"))
        kwargs[name] = d.pick((torch.ones(nb, bs, H + 1, device=dev), torch.ones(nb, bs, H, dtype=torch.float16,
                                                                                   device=dev),
                               torch.ones(nb * bs * H, device=dev)))
        return Case(REFUSE, "cache.token_head.shape", (name,))

    @add("cache.token_head.aliased", not static and variant != "constructor")
    def _():
        s = kwargs.get("k_scale")
        if s is None:
            s = guarded(nb * bs * H, torch.float32, dev, h.world, f"{label}.k_scale").view(nb, bs, H).fill_(1.0)
        kwargs["k_scale"] = kwargs["v_scale"] = s
        return Case(REFUSE, "cache.token_head.aliased", ("v_scale",))

    @add("allocate.size", variant == "allocate")
    def _():
        name = d.pick(("num_blocks", "block_size", "num_kv_heads", "head_size"))
        state[name] = d.pick((0, -1, True, 2.0))
        return Case(REFUSE, "allocate.size", (name,))

    @add("allocate.device", variant == "allocate")
    def _():
        state["device"] = d.pick(("mps", "xla", 5) + (() if torch.cuda.is_available() else ("cuda",)))
        return Case(REFUSE, "allocate.device", ("device",))

    @add("cache.constructor.scale_value", variant == "constructor" and static)
    def _():
        name = d.pick(("k_scale", "v_scale"))
        kwargs[name] = torch.full(() if gran == "tensor" else (H,), d.pick(BAD_SCALES[:4]), device=dev)
        return Case(REFUSE, "cache.constructor.scale_value", (name,))

    @add("cache.constructor.fmt", variant == "constructor")
    def _():
        state["fmt"] = d.pick((kv_dtype, None))
        return Case(REFUSE, "cache.constructor.fmt", ("fmt",))

    case = OK
    if mutate and options and d.chance(cfg.invalid):
        case = options[d.int(0, len(options) - 1)][1]()

    if variant == "allocate":
        sizes = {n: state.get(n, v) for n, v in (("num_blocks", nb), ("block_size", bs), ("num_kv_heads", H),
                                                  ("head_size", D))}
        akw = {k: v for k, v in kwargs.items() if k != "kv_dim"}
        akw.setdefault("kv_dtype", kv_dtype)
        akw["device"] = state.get("device", dev)

        def fill_allocated(c: KVCache) -> None:
            fill(c.key_cache)
            fill(c.value_cache)

        return CacheDraw(lambda: KVCache.allocate(*sizes.values(), **akw), case, what, geometry, (), fill_allocated)
    if variant == "constructor":
        t = args[0]
        k, v = (t.select(0, 0), t.select(0, 1)) if len(args) == 1 else args
        k, v = k.view(fmt.torch_dtype) if k.dtype == torch.uint8 else k, v.view(fmt.torch_dtype) \
            if v.dtype == torch.uint8 else v
        ks, vs = kwargs["k_scale"], kwargs["v_scale"]
        the_fmt = state.get("fmt", fmt)
        return CacheDraw(lambda: KVCache(k, v, ks, vs, the_fmt, layout, gran), case, what, geometry, (k, v))
    return CacheDraw(lambda: KVCache.from_tensors(*args, **kwargs), case, what + f" {sorted(kwargs)}", geometry,
                     tuple(args))


# ------------------------------------------------------------------------------------------- the machine


def draw_kv(d: Draw, n: int, H: int, D: int, dtype: torch.dtype, device, *, specials: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``key, value [n, H, D]``: normal values times an amplitude, sometimes with inf/-inf/NaN/-0/huge."""
    g = d.seed()
    amp = d.pick((1.0, 0.01, 37.0, 1000.0))
    special = specials and d.chance(0.1)
    out = []
    for _ in range(2):
        x = torch.randn(n, H, D, generator=g) * amp
        if special and x.numel():
            pick = torch.randint(0, 10, x.shape, generator=g)
            for code, v in ((1, math.inf), (2, -math.inf), (3, math.nan), (4, -0.0), (5, torch.finfo(dtype).max / 2)):
                x = torch.where(pick == code, torch.tensor(v), x)
        out.append(x.to(dtype).to(device))
    return out[0], out[1]


def _queries(d: Draw, T: int, Hq: int, D: int, dtype, device) -> torch.Tensor:
    g = d.seed()
    return (torch.randn(T, Hq, D, generator=g) * d.pick((1.0, 0.1, 8.0))).to(dtype).to(device)


def _over_storage(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A ``dtype`` tensor of ``shape`` over ``t``'s storage, overlapping ``t`` (None if it does not fit)."""
    size = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    s = t.untyped_storage()
    at = (t.storage_offset() * t.element_size()) // size
    if numel == 0 or (at + numel) * size > s.nbytes():
        return None
    return torch.empty(0, dtype=dtype, device=t.device).set_(s, at, shape, _strides(shape))


class ApiMachine(RuleBasedStateMachine):
    """Random API call sequences (see the module docstring); :func:`api_machine` gives it a config."""

    config = FuzzConfig()
    MAX_CACHES, MAX_PLANS, MAX_RESULTS = 5, 5, 4

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(self.config)
        self.h.log = note
        self.caches: list[Tracked] = []
        self.plans: list[Planned] = []
        self.results: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.count = 0

    # -- helpers ----------------------------------------------------------------------------------
    def _label(self) -> str:
        self.count += 1
        return f"cache{self.count}"

    def _keep(self, items: list, item, limit: int) -> None:
        items.append(item)
        del items[:-limit]

    def _cache(self, d: Draw, spec=None) -> Tracked:
        """A held cache, of ``spec`` when one is held and the draw says so."""
        same = [t for t in self.caches if spec is not None and t.cache.spec == spec]
        pool = same if same and d.chance(0.85) else self.caches
        return pool[d.int(0, len(pool) - 1)]

    def _invalid(self, d: Draw, options: list[tuple[str, Callable]]) -> Case | None:
        """Maybe apply one of ``options`` (family, apply() -> Case); None when the call stays valid."""
        options = [(f, fn) for f, fn in options if self.config.drawn(f)]
        if not options or not d.chance(self.config.invalid):
            return None
        return options[d.int(0, len(options) - 1)][1]()

    # -- caches -----------------------------------------------------------------------------------
    @initialize(data=st.data())
    def first_cache(self, data) -> None:
        self._build(Draw(data), mutate=False)

    @rule(data=st.data())
    def build_cache(self, data) -> None:
        self._build(Draw(data), mutate=True)

    def _build(self, d: Draw, *, mutate: bool) -> None:
        label = self._label()
        cd = draw_cache(d, self.h, self.config, label, mutate=mutate)
        t = self.h.build(cd.case, cd.build, label, what=cd.what)
        if t is None:
            return
        c = t.cache
        got = (c.kv_dtype, c.layout, c.scale_granularity, c.num_blocks, c.block_size, c.num_kv_heads, c.head_size)
        if got != cd.geometry:
            raise FuzzFailure(f"build {cd.what}: the cache is {got}")
        if cd.tensors and (_key(c.key_cache) != _key(cd.tensors[0]) or _key(c.value_cache) != _key(cd.tensors[-1])):
            raise FuzzFailure(f"build {cd.what}: the cache does not wrap the given tensors (not zero-copy)")
        if cd.fill is not None:
            cd.fill(c)
            self.h.world.accept()
        self._keep(self.caches, t, self.MAX_CACHES)

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def derive(self, data) -> None:
        d = Draw(data)
        src = self.caches[d.int(0, len(self.caches) - 1)]
        op = d.pick(("slice_heads", "clone", "to", "copy_", "replace", "tamper"))
        getattr(self, f"_{op}")(d, src)

    def _slice_heads(self, d: Draw, src: Tracked) -> None:
        c, H = src.cache, src.cache.num_kv_heads
        case = self._invalid(d, [("cache.slice_heads.bounds", lambda: Case(REFUSE, "cache.slice_heads.bounds",
                                                                            ("start",)))])
        if case is not None:
            start, stop = d.pick(((0, 0), (-1, 1), (0, H + 1), (H, H), (1.0, 2), (False, True), (0, None)))
        else:
            case = OK
            start = d.int(0, H - 1)
            stop = d.int(start + 1, H)
        t = self.h.derive(case, "slice_heads", lambda: c.slice_heads(start, stop), src, self._label(),
                          what=f"{src.label}[{start!r}:{stop!r}]")
        if t is None:
            return
        dim = 2 if c.layout == "NHD" else 1
        if t.cache.num_kv_heads != stop - start or _key(t.cache.key_cache) != _key(c.key_cache) or not torch.equal(
                as_bits(t.cache.key_cache), as_bits(c.key_cache.narrow(dim, start, stop - start))):
            raise FuzzFailure(f"slice_heads {src.label}[{start}:{stop}]: not the heads' zero-copy view")
        self._keep(self.caches, t, self.MAX_CACHES)

    def _clone(self, d: Draw, src: Tracked) -> None:
        t = self.h.derive(OK, "clone", src.cache.clone, src, self._label(), what=src.label)
        if t is None:
            return
        mine = {_key(x) for x in (src.cache.key_cache, src.cache.value_cache, src.cache.k_scale, src.cache.v_scale)}
        if not t.cache.same_bytes(src.cache) or any(_key(getattr(t.cache, n)) in mine for n in
                                                   ("key_cache", "value_cache", "k_scale", "v_scale")):
            raise FuzzFailure(f"clone {src.label}: not a deep copy with the same bytes")
        self._keep(self.caches, t, self.MAX_CACHES)

    def _to(self, d: Draw, src: Tracked) -> None:
        case = self._invalid(d, [("cache.to.device", lambda: Case(REFUSE, "cache.to.device", ("device",)))])
        if case is not None:
            device = d.pick(("mps", "xla", 5) + (() if torch.cuda.is_available() else ("cuda",)))
        else:
            case, device = OK, self.h.device
        t = self.h.derive(case, "to", lambda: src.cache.to(device), src, self._label(), what=f"{src.label} {device!r}")
        if t is None:
            return
        if not t.cache.same_bytes(src.cache) or t.cache.device != self.h.device:
            raise FuzzFailure(f"to {src.label}: not the same bytes on {device}")
        copy = Case(VALID, "cache.to.copy")
        if self.config.drawn(copy.family) and any(
                may_share_bytes(getattr(t.cache, n), getattr(src.cache, n)) for n in ("key_cache", "value_cache")):
            raise FuzzFailure(f"to {src.label} {device!r} [{copy.family}]: the 'copy on device' shares memory with "
                              "the cache it was made from")
        self._keep(self.caches, t, self.MAX_CACHES)

    def _copy_(self, d: Draw, dst: Tracked) -> None:
        if (dst.broken or dst.suspect) and not self.config.drawn("cache.copy_.tamper"):
            return
        same = [t for t in self.caches if t.cache.spec == dst.cache.spec
                and (self.config.drawn("cache.copy_.tamper") or not (t.broken or t.suspect))]
        other = [t for t in self.caches if t.cache.spec != dst.cache.spec]
        case = self._invalid(d, [
            ("cache.copy_.other_spec", lambda: Case(REFUSE, "cache.copy_.other_spec", ("other",)) if other else None),
            ("cache.copy_.type", lambda: Case(REFUSE, "cache.copy_.type", ("other",))),
        ])
        if case is None:
            src = same[d.int(0, len(same) - 1)]
            self.h.copy_into(OK, dst, src, what=f"{dst.label} <- {src.label}")
        elif case.family == "cache.copy_.other_spec":
            src = other[d.int(0, len(other) - 1)]
            self.h.copy_into(case, dst, src, what=f"{dst.label} <- {src.label}")
        else:
            bad = d.pick((None, dst.cache.key_cache, "cache"))
            self.h.call(case + dst.case("cache.copy_"), "copy_", lambda: dst.cache.copy_(bad),
                        what=f"{dst.label} <- {bad!r:.20}")

    def _replace(self, d: Draw, src: Tracked) -> None:
        c = src.cache
        static = c.scale_granularity != "token_head"
        shape = tuple(c.k_scale.shape)
        case = self._invalid(d, [
            ("cache.replace.scale_value", lambda: Case(REFUSE, "cache.replace.scale_value", ("k_scale",))
             if static else None),
            ("cache.replace.shape", lambda: Case(REFUSE, "cache.replace.shape", ("value_cache", "key_cache"))),
        ])
        fields: dict[str, Any]
        if case is None:
            case = Case(VALID, "cache.replace.valid")
            if not self.config.drawn(case.family):
                return
            if static:
                fields = {"k_scale": torch.full(shape, d.pick(SCALES), device=self.h.device)}
            else:
                r = guarded(c.k_scale.numel(), torch.float32, self.h.device, self.h.world, "replaced.k_scale")
                fields = {"k_scale": r.view(shape).fill_(0.5)}
        elif case.family == "cache.replace.scale_value":
            fields = {"k_scale": torch.full(shape, d.pick(BAD_SCALES[:4]), device=self.h.device)}
        else:
            fields = {"key_cache": c.key_cache.narrow(3, 0, c.head_size - 1) if c.head_size > 1
                      else c.key_cache.narrow(0, 0, 0)}
        t = self.h.derive(case, "dataclasses.replace", lambda: dataclasses.replace(c, **fields), src, self._label(),
                          what=f"{src.label} {sorted(fields)}")
        if t is not None:
            self._keep(self.caches, t, self.MAX_CACHES)

    def _tamper(self, d: Draw, src: Tracked) -> None:
        """Change a cache's tensors after it was built, as a careless engine could (no call is checked here:
        the calls that follow on that cache are)."""
        c = src.cache
        how = d.pick(("shrink", "move", "scale"))
        if not self.config.drawn(f"tamper.{how}"):
            return
        names = ["key_cache", "value_cache"] + (["k_scale", "v_scale"] if c.scale_granularity == "token_head" else [])
        if how in ("shrink", "move"):
            name = d.pick(names)
            t = getattr(c, name)
            if how == "shrink" and t.shape[0] == 0:
                return
            shape = (d.int(0, t.shape[0] - 1), *t.shape[1:]) if how == "shrink" else tuple(t.shape)
            span = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
            storage_dtype = torch.float32 if t.dtype == torch.float32 else torch.uint8
            region = guarded(math.prod(shape), storage_dtype, self.h.device, self.h.world,
                             f"{src.label}.{name} ({how})", pad=span + 64).view(t.dtype)
            if how == "move":
                region.view(shape).copy_(t)
            t.set_(region.untyped_storage(), region.storage_offset(), shape, _strides(shape))
            self.h.world.track(t, f"{src.label}.{name}")
            for held in self.caches:
                if any(getattr(held.cache, n) is t for n in names):
                    held.broken = held.broken or how == "shrink"
                    held.suspect = True
            note(f"tamper: {src.label}.{name}.set_(storage of shape {shape})")
        else:
            name = d.pick(("k_scale", "v_scale"))
            s = getattr(c, name)
            bad = d.pick((0.0, math.nan, -1.0, math.inf, 3e38))
            s.view(-1)[d.int(0, s.numel() - 1)] = bad
            for held in self.caches:
                if any(_key(getattr(held.cache, n)) == _key(s) for n in ("k_scale", "v_scale")):
                    held.suspect = True
            note(f"tamper: {src.label}.{name} element set to {bad}")
        self.h.world.accept()

    # -- steps ------------------------------------------------------------------------------------
    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def plan(self, data) -> None:
        d = Draw(data)
        self._plan(d, self._cache(d))

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def engine_step(self, data) -> None:
        """Plan a step, then write and attend with it on each held cache of its spec (an engine's layers)."""
        d = Draw(data)
        p = self._plan(d, self._cache(d))
        if p is None:
            return
        for target in [t for t in self.caches if t.cache.spec == p.meta.spec][:2]:
            if p.meta.slot_mapping is not None:
                self._write_with(d, p, target)
            self._attend_with(d, p, target)

    def _plan(self, d: Draw, src: Tracked) -> Planned | None:
        spec = src.cache.spec
        step = draw_step(d, spec, self.config)
        backend = d.pick(self.config.backends)
        case, over = mutate_step(d, step, spec, self.config)
        args = dict(num_q_heads=step.num_q_heads, query_dtype=step.query_dtype, backend=backend, **step.kw)
        cache_arg = over.pop("cache", src.cache if d.chance(0.8) else spec)
        args.update(over)
        meta = self.h.plan(case, cache_arg, what=f"{src.label} {backend} {_describe_step(step)}", **args)
        if meta is None:
            return None
        if case.kind == VALID:
            _check_plan(meta, step, backend)
        planned = Planned(meta, backend, case, case)
        self._keep(self.plans, planned, self.MAX_PLANS)
        return planned

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def update(self, data) -> None:
        """Refill a plan's buffers in place (``AttentionMetadata.update``, a CUDA-graph replay's step), then
        write and attend with it on a cache of its spec."""
        d = Draw(data)
        p = self.plans[d.int(0, len(self.plans) - 1)]
        meta, spec = p.meta, p.meta.spec
        if p.attention.kind != VALID or not self.config.drawn("update"):
            return
        bs, nb, S, cols = spec.block_size, spec.num_blocks, meta.num_seqs, meta.block_tables.shape[1]
        starts = meta.query_start_loc.tolist()
        q_lens = [starts[i + 1] - starts[i] for i in range(S)]
        cap = min(cols * bs, meta.max_seq_len)
        seq_lens = [d.int(q, cap) if q <= cap else q for q in q_lens]
        rows = [[d.int(0, nb - 1) for _ in range(cols)] for _ in range(S)]
        dev = self.h.device
        kw: dict[str, Any] = {"block_tables": torch.tensor(rows, dtype=torch.int32, device=dev).reshape(S, cols),
                              "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=dev)}
        if not meta.is_decode:
            kw["query_start_loc"] = meta.query_start_loc.clone()
        if meta.slot_mapping is not None:
            seen: set[int] = set()
            mapping = []
            for r, n, q in zip(rows, seq_lens, q_lens, strict=True):
                for pos in range(n - q, n):
                    s = r[pos // bs] * bs + pos % bs
                    mapping.append(-1 if s in seen else s)
                    seen.add(s)
            mapping += [-1] * (meta.slot_mapping.shape[0] - len(mapping))
            kw["slot_mapping"] = torch.tensor(mapping[:meta.slot_mapping.shape[0]], dtype=torch.int64, device=dev)
        case = OK
        if d.chance(self.config.invalid):
            case = self._invalid(d, [
                ("update.shape", lambda: (kw.update(seq_lens=torch.zeros(S + 1, dtype=torch.int32,
                                                                         device=self.h.device)),
                                          Case(REFUSE, "update.shape", ("seq_lens", "block_tables")))[1]),
                ("update.seq_lens.past_plan", lambda: (kw.update(seq_lens=torch.full(
                    (S,), cols * bs + 1, dtype=torch.int32, device=self.h.device)),
                    Case(REFUSE, "update.seq_lens.past_plan", ("seq_lens", "max_seq_len")))[1] if S else None),
                ("update.kind", lambda: (kw.update(query_start_loc=None if not meta.is_decode else torch.arange(
                    S + 1, dtype=torch.int32, device=self.h.device)),
                    Case(REFUSE, "update.kind", ("query_start_loc", "num_tokens")))[1]),
            ]) or OK
        before = (meta.block_tables.clone(), meta.seq_lens.clone())

        def refill():
            meta.update(**kw)
            return meta

        if self.h.call(case, "AttentionMetadata.update", refill, what=f"{p.backend} seq_lens={seq_lens}",
                       inputs=tuple(v for v in kw.values() if isinstance(v, torch.Tensor))) is None:
            if not (torch.equal(before[0], meta.block_tables) and torch.equal(before[1], meta.seq_lens)):
                raise FuzzFailure("AttentionMetadata.update: refused, but the metadata's buffers changed")
            return
        if meta.seq_lens.tolist() != seq_lens or meta.block_tables.tolist() != rows:
            raise FuzzFailure(f"AttentionMetadata.update seq_lens={seq_lens}: the buffers hold other values")
        for target in [t for t in self.caches if t.cache.spec == spec][:1]:
            if meta.slot_mapping is not None:
                self._write_with(d, p, target)
            self._attend_with(d, p, target)

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def write_planned(self, data) -> None:
        d = Draw(data)
        p = self.plans[d.int(0, len(self.plans) - 1)]
        self._write_with(d, p, self._cache(d, p.meta.spec))

    def _write_with(self, d: Draw, p: Planned, target: Tracked) -> None:
        meta, spec = p.meta, p.meta.spec
        case = p.write
        if target.cache.spec != spec:
            case = case + Case(REFUSE, "write.cache.other_spec", ("cache",))
        if meta.slot_mapping is None:
            if not self.config.drawn("write.metadata.no_slots"):
                return
            case = case + Case(REFUSE, "write.metadata.no_slots", ("metadata",))
        n = meta.slot_mapping.shape[0] if meta.slot_mapping is not None else d.int(0, 3)
        dtype = meta.query_dtype if d.chance(0.8) else d.pick(self.config.io_dtypes)
        key, value = draw_kv(d, n, spec.num_kv_heads, spec.head_size, dtype, self.h.device)
        call = {"key": key, "value": value, "meta": meta, "target": target}
        bad = self._invalid(d, self._kv_mutations(d, call, "write", one_shot=False) + [
            ("write.metadata.type", lambda: (call.update(meta=d.pick((None, {}, "meta"))),
                                             Case(REFUSE, "write.metadata.type", ("metadata",)))[1]),
            ("write.cache.type", lambda: (call.update(target=Tracked(d.pick((None, key, spec)), "not-a-cache")),
                                          Case(REFUSE, "write.cache.type", ("cache",)))[1]),
        ])
        case = case + (bad or OK)
        self.h.write(case, call["target"], call["key"], call["value"], call["meta"],
                     what=f"{call['target'].label} {p.backend} n={n} {dtype}")

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def write_one_shot(self, data) -> None:
        d = Draw(data)
        target = self._cache(d)
        spec = target.cache.spec
        n_valid = d.int(0, min(4, spec.num_slots))
        mapping = d.permutation(spec.num_slots)[:n_valid] + [d.pick((-1, -3)) for _ in range(d.int(0, 2))]
        order = d.permutation(len(mapping))
        slots = torch.tensor([mapping[i] for i in order], dtype=d.pick((torch.int64, torch.int32)),
                             device=self.h.device)
        backend = d.pick(self.config.backends)
        dtype = d.pick(self.config.io_dtypes)
        key, value = draw_kv(d, len(mapping), spec.num_kv_heads, spec.head_size, dtype, self.h.device)
        call = {"key": key, "value": value, "slots": slots, "target": target, "backend": backend}
        checked = values_checked(self.h.device, None)
        n = len(mapping)

        def slot(family: str, names=("slot_mapping",), value_level: bool = False):
            def apply(new):
                def go():
                    call["slots"] = new()
                    if value_level and not checked:
                        return Case(EITHER, family)
                    return Case(REFUSE, family, names)
                return go
            return apply

        def set_slot(v):
            t = slots.clone()
            t[d.int(0, n - 1)] = v
            return t

        options = self._kv_mutations(d, call, "write1", one_shot=True) + [
            ("write1.slot_mapping.dtype", slot("write1.slot_mapping.dtype")(lambda: slots.float())),
            ("write1.slot_mapping.ndim", slot("write1.slot_mapping.ndim")(lambda: slots[:, None])),
            ("write1.slot_mapping.length", slot("write1.slot_mapping.length")(
                lambda: torch.cat([slots, slots.new_full((1,), -1)]))),
            ("write1.slot_mapping.type", slot("write1.slot_mapping.type")(lambda: slots.tolist())),
            ("write1.slot_mapping.device", slot("write1.slot_mapping.device")(lambda: slots.to("meta"))),
            ("write1.backend", lambda: (call.update(backend=d.pick(("nope", 3, None))),
                                        Case(REFUSE, "write1.backend", ("backend",)))[1]),
            ("write1.cache.type", lambda: (call.update(target=Tracked(d.pick((None, key, spec)), "not-a-cache")),
                                           Case(REFUSE, "write1.cache.type", ("cache",)))[1]),
        ]
        if n:
            big = (2**40,) if slots.dtype == torch.int64 else (2**31 - 1,)
            options.append(("write1.slot_mapping.out_of_range",
                            slot("write1.slot_mapping.out_of_range", value_level=True)(
                                lambda: set_slot(d.pick((spec.num_slots, spec.num_slots + 1) + big)))))
        valid = [i for i, s in enumerate(slots.tolist()) if s >= 0]
        if checked and valid and n >= 2:
            def duplicate():
                i = d.pick(valid)
                t = slots.clone()
                t[d.pick([j for j in range(n) if j != i])] = slots[i]
                return t
            options.append(("write1.slot_mapping.duplicate", slot("write1.slot_mapping.duplicate")(duplicate)))
        case = self._invalid(d, options) or OK
        self.h.write_one_shot(case, call["target"], call["key"], call["value"], call["slots"], call["backend"],
                              what=f"{call['target'].label} {call['backend']!r} n={n} {dtype}")

    def _kv_mutations(self, d: Draw, call: dict, prefix: str, *, one_shot: bool) -> list[tuple[str, Callable]]:
        """Invalid key/value arguments of a write (they replace ``call["key"]``/``["value"]``)."""
        key, value = call["key"], call["value"]
        n, H, D = key.shape
        dev = key.device
        other = [t for t in self.config.io_dtypes if t != key.dtype]

        def refuse(family, *names):
            return Case(REFUSE, f"{prefix}.{family}", names)

        def kv(k, v, family, *names):
            def go():
                call.update(key=k() if callable(k) else k, value=v() if callable(v) else v)
                return refuse(family, *names)
            return go

        def noncontiguous(x):
            wide = torch.zeros(n, H, 2 * D, dtype=x.dtype, device=dev)[..., ::2]
            return wide.copy_(x)

        def aliasing():
            t = call["target"].cache
            k = _over_storage(t.key_cache, key.dtype, (n, H, D)) if isinstance(t, KVCache) else None
            if k is None:
                return None
            call["key"] = k
            return refuse("key.aliases_cache", "key")

        def requires_grad():
            call["key"] = key.clone().requires_grad_()
            return Case(VALID, f"{prefix}.key.requires_grad")

        out = [
            (f"{prefix}.key.dtype", kv(lambda: key.to(d.pick((torch.float64, torch.int32))), value, "key.dtype",
                                        "key")),
            (f"{prefix}.key.ndim", kv(key.reshape(n, H * D), value.reshape(n, H * D), "key.ndim", "key")),
            (f"{prefix}.key.heads", kv(torch.zeros(n, H + 1, D, dtype=key.dtype, device=dev),
                                       torch.zeros(n, H + 1, D, dtype=key.dtype, device=dev), "key.heads", "key")),
            (f"{prefix}.key.tokens", kv(torch.zeros(n + 1, H, D, dtype=key.dtype, device=dev),
                                        torch.zeros(n + 1, H, D, dtype=key.dtype, device=dev), "key.tokens",
                                        *(("key", "slot_mapping") if one_shot else ("key",)))),
            (f"{prefix}.value.shape", kv(key, torch.zeros(n + 1, H, D, dtype=key.dtype, device=dev), "value.shape",
                                         "value")),
            (f"{prefix}.key.device", kv(lambda: key.to("meta"), value, "key.device", "key")),
            (f"{prefix}.key.aliases_cache", aliasing),
            (f"{prefix}.key.requires_grad", requires_grad),
        ]
        if other:
            out.append((f"{prefix}.value.dtype", kv(key, lambda: value.to(d.pick(other)), "value.dtype", "value")))
        if D > 1 and n > 0:
            out.append((f"{prefix}.key.noncontiguous", kv(noncontiguous(key), value, "key.noncontiguous", "key")))
        return out

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def attend_planned(self, data) -> None:
        d = Draw(data)
        p = self.plans[d.int(0, len(self.plans) - 1)]
        self._attend_with(d, p, self._cache(d, p.meta.spec))

    def _attend_with(self, d: Draw, p: Planned, target: Tracked) -> None:
        meta, spec = p.meta, p.meta.spec
        case = p.attention
        if target.cache.spec != spec:
            case = case + Case(REFUSE, "attend.cache.other_spec", ("cache",))
        T, Hq, D = meta.num_tokens, meta.num_q_heads, spec.head_size
        query = _queries(d, T, Hq, D, meta.query_dtype, self.h.device)
        call: dict[str, Any] = {"query": query, "meta": meta, "target": target, "out": self._out(d, query),
                                "return_lse": d.chance(0.5), "layer_scales": None}
        fp8 = meta.options.fp8_attention
        if fp8 and d.chance(0.3):
            H = spec.num_kv_heads
            call["layer_scales"] = {"q_scale": torch.full(d.pick(((), (H,), (Hq,))), d.pick((0.01, 1.0)),
                                                          device=self.h.device), "prob_scale": d.pick((1.0, 0.25))}
        options = self._query_mutations(d, call, "attend") + [
            ("attend.metadata.type", lambda: (call.update(meta=d.pick((None, {}, "meta"))),
                                              Case(REFUSE, "attend.metadata.type", ("metadata",)))[1]),
            ("attend.cache.type", lambda: (call.update(target=Tracked(d.pick((None, query, spec)), "not-a-cache")),
                                           Case(REFUSE, "attend.cache.type", ("cache",)))[1]),
        ]
        if not fp8:
            options.append(("attend.layer_scales.without_fp8", lambda: (
                call.update(layer_scales={"prob_scale": 1.0}),
                Case(REFUSE, "attend.layer_scales.without_fp8", ("layer_scales",)))[1]))
        else:
            options.append(("attend.layer_scales.bad", lambda: (
                call.update(layer_scales=d.pick(({"bogus": 1.0}, {"prob_scale": 0.0}, {"prob_scale": math.nan},
                                                 {"q_scale": torch.ones(Hq + 1, device=self.h.device)},
                                                 {"q_scale": torch.ones((), dtype=torch.float64)}, [1.0]))),
                Case(REFUSE, "attend.layer_scales.bad", ("layer_scales",)))[1]))
        case = case + (self._invalid(d, options) or OK)
        res = self.h.attend(case, call["target"], call["query"], call["meta"], out=call["out"],
                            return_lse=call["return_lse"], layer_scales=call["layer_scales"],
                            what=f"{call['target'].label} {p.backend} T={T} Hq={Hq} {meta.query_dtype}"
                                 f"{' out' if call['out'] is not None else ''}{' lse' if call['return_lse'] else ''}")
        if res is not None and res[1] is not None and case.kind == VALID:
            self._keep(self.results, (res[0].detach().clone(), res[1].clone()), self.MAX_RESULTS)

    def _out(self, d: Draw, query: torch.Tensor) -> torch.Tensor | None:
        """None, or an ``out`` of NaN in a guarded buffer."""
        if d.chance(0.5):
            return None
        r = guarded(query.numel(), query.dtype, self.h.device, self.h.world, "out").view(query.shape)
        return r.fill_(math.nan)

    def _query_mutations(self, d: Draw, call: dict, prefix: str, *, rows_checked: bool = True
                         ) -> list[tuple[str, Callable]]:
        """Invalid query/out arguments of an attention call (they replace ``call["query"]``/``["out"]``).
        ``rows_checked``: a query with a row more is refused (else, a one-shot prefill with the value checks
        off, the row is one no sequence covers)."""
        query = call["query"]
        T, Hq, D = query.shape
        dev = query.device
        # one-shot: the query gives the dtype (any I/O dtype is valid); planned: the metadata does
        other = [torch.float64] + ([t for t in self.config.io_dtypes if t != query.dtype] if prefix == "attend" else [])

        def set_(family, names, **values):
            def go():
                call.update({k: (v() if callable(v) else v) for k, v in values.items()})
                return Case(REFUSE, f"{prefix}.{family}", names)
            return go

        def requires_grad():
            call["query"] = query.clone().requires_grad_()
            return Case(VALID, f"{prefix}.query.requires_grad")

        def out_aliases_cache():
            t = call["target"].cache
            o = _over_storage(t.value_cache, query.dtype, tuple(query.shape)) if isinstance(t, KVCache) else None
            if o is None:
                return None
            call["out"] = o
            return Case(REFUSE, f"{prefix}.out.aliases_cache", ("out",))

        out = [
            (f"{prefix}.query.dtype", set_("query.dtype", ("query",), query=lambda: query.to(d.pick(other)))),
            (f"{prefix}.query.shape", set_("query.shape", ("query",),
                                           query=lambda: torch.zeros(T + 1, Hq, D, dtype=query.dtype, device=dev))
             if rows_checked else lambda: (call.update(query=torch.zeros(T + 1, Hq, D, dtype=query.dtype, device=dev),
                                                       out=None), Case(EITHER, f"{prefix}.query.shape"))[1]),
            (f"{prefix}.query.device", set_("query.device", ("query",), query=lambda: query.to("meta"))),
            (f"{prefix}.query.requires_grad", requires_grad),
            (f"{prefix}.out.dtype", set_("out.dtype", ("out",), out=lambda: torch.zeros_like(
                query, dtype=d.pick([t for t in self.config.io_dtypes if t != query.dtype] + [torch.float64])))),
            (f"{prefix}.out.shape", set_("out.shape", ("out",),
                                         out=lambda: torch.zeros(T + 1, Hq, D, dtype=query.dtype, device=dev))),
            (f"{prefix}.out.requires_grad", set_("out.requires_grad", ("out",),
                                                 out=lambda: torch.zeros_like(query).requires_grad_())),
            (f"{prefix}.out.aliases_cache", out_aliases_cache),
        ]
        if query.numel():
            out.append((f"{prefix}.out.is_query", set_("out.is_query", ("out",), out=query)))
        if D > 1 and query.numel():
            def nc():
                return torch.zeros(T, Hq, 2 * D, dtype=query.dtype, device=dev)[..., ::2].copy_(query)
            out.append((f"{prefix}.query.noncontiguous", set_("query.noncontiguous", ("query",), query=nc)))
            out.append((f"{prefix}.out.noncontiguous", set_("out.noncontiguous", ("out",), out=nc)))
        return out

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def attend_one_shot(self, data) -> None:
        d = Draw(data)
        target = self._cache(d)
        spec = target.cache.spec
        step = draw_step(d, spec, self.config, csr=False, slots=False)
        step.kw.pop("num_tokens", None)
        backend = d.pick(self.config.backends)
        step.kw["backend"] = backend
        query = _queries(d, step.num_tokens, step.num_q_heads, spec.head_size, step.query_dtype, self.h.device)
        call: dict[str, Any] = {"query": query, "target": target, "out": self._out(d, query),
                                "return_lse": d.chance(0.5)}
        case, over = mutate_step(d, step, spec, self.config, one_shot=True)
        step.kw.update(over)
        kw = step.kw
        if case is step.case:
            H, S = spec.num_kv_heads, len(step.seq_lens)

            def forbidden():
                name = d.pick(("num_q_heads", "query_dtype", "num_tokens", "slot_mapping", "kv_indptr", "kv_indices",
                               "kv_last_page_len"))
                kw[name] = d.pick((1, None, torch.zeros(1, dtype=torch.int32, device=self.h.device)))
                return Case(REFUSE, "attend1.forbidden", (name,))

            def set_(family, names, **values):
                def go():
                    for k, v in values.items():
                        v = v() if callable(v) else v
                        (call if k in call else kw)[k] = v
                    return Case(REFUSE, family, names)
                return go

            T, Hq, D = query.shape
            zeros = dict(dtype=query.dtype, device=self.h.device)
            options = self._query_mutations(d, call, "attend1", rows_checked=step.checked or step.decode) + [
                ("attend1.forbidden", forbidden),
                ("attend1.query.ndim", set_("attend1.query.ndim", ("query",), query=query.reshape(T, Hq * D))),
                ("attend1.query.heads", set_("attend1.query.heads", ("query",),
                                             query=lambda: torch.zeros(T, d.pick((0, Hq + 1) if H > 1 else (0,)), D,
                                                                       **zeros))),
                ("attend1.query.head_size", set_("attend1.query.head_size", ("query",),
                                                 query=torch.zeros(T, Hq, D + 1, **zeros))),
                ("attend1.cache.type", lambda: (call.update(target=Tracked(d.pick((None, query)), "not-a-cache")),
                                                Case(REFUSE, "attend1.cache.type", ("cache",)))[1]),
                ("attend1.block_tables.type", set_("attend1.block_tables.type", ("block_tables",),
                                                   block_tables=lambda: kw["block_tables"].tolist())),
                ("attend1.seq_lens.type", set_("attend1.seq_lens.type", ("seq_lens",),
                                               seq_lens=lambda: kw["seq_lens"].tolist())),
            ]
            if step.decode:
                options.append(("attend1.decode_tokens", set_("attend1.decode_tokens", ("query",),
                                                              query=torch.zeros(S + 1, Hq, D, **zeros))))
            case = case + (self._invalid(d, options) or OK)
        tables, lens = kw.pop("block_tables"), kw.pop("seq_lens")
        self.h.attend_one_shot(case, call["target"], call["query"], tables, lens, out=call["out"],
                               return_lse=call["return_lse"],
                               what=f"{call['target'].label} {backend!r} {_describe_step(step)}", **kw)

    @rule(data=st.data())
    def merge(self, data) -> None:
        d = Draw(data)
        if self.results and d.chance(0.7):
            out_a, lse_a = self.results[d.int(0, len(self.results) - 1)]
        else:
            out_a, lse_a = self._state(d, (d.int(0, 3), d.int(1, 4), d.pick(self.config.head_sizes)),
                                       d.pick(self.config.io_dtypes))
        twins = [r for r in self.results if r[0].shape == out_a.shape and r[0].dtype == out_a.dtype]
        if twins and d.chance(0.5):
            out_b, lse_b = twins[d.int(0, len(twins) - 1)]
        else:
            out_b, lse_b = self._state(d, tuple(out_a.shape), out_a.dtype)
        call = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
        T, Hq, D = out_a.shape
        other = [t for t in self.config.io_dtypes if t != out_a.dtype]

        def set_(family, name, value):
            def go():
                call[name] = value() if callable(value) else value
                return Case(REFUSE, family, (name,))
            return go

        options = [
            ("merge.ndim", set_("merge.ndim", "out_a", lambda: out_a.reshape(T, Hq * D))),
            ("merge.shape", set_("merge.shape", "out_b", lambda: torch.zeros(T + 1, Hq, D, dtype=out_a.dtype,
                                                                             device=out_a.device))),
            ("merge.lse_dtype", set_("merge.lse_dtype", "lse_a", lambda: lse_a.double())),
            ("merge.lse_shape", set_("merge.lse_shape", "lse_b", lambda: lse_b[:, None])),
            ("merge.type", set_("merge.type", "out_a", lambda: out_a.tolist())),
            ("merge.device", set_("merge.device", "out_b", lambda: out_b.to("meta"))),
        ]
        if other:
            options.append(("merge.dtype", set_("merge.dtype", "out_b", lambda: out_b.to(d.pick(other)))))
        case = self._invalid(d, options) or OK
        self.h.merge(case, call["out_a"], call["lse_a"], call["out_b"], call["lse_b"],
                     what=f"{tuple(out_a.shape)} {out_a.dtype}")

    def _state(self, d: Draw, shape: tuple[int, int, int], dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A synthetic attention state: an output and a float32 lse, some rows -inf (no key)."""
        g = d.seed()
        out = (torch.randn(shape, generator=g) * d.pick((1.0, 100.0))).to(dtype).to(self.h.device)
        lse = torch.randn(shape[:2], generator=g) * d.pick((1.0, 30.0, 1e4))
        lse = torch.where(torch.rand(shape[:2], generator=g) < 0.2, torch.tensor(-math.inf), lse)
        return out, lse.to(self.h.device)

    @invariant()
    def nothing_else_changed(self) -> None:
        """No tracked byte changes between calls (asynchronous work included)."""
        self.h.world.verify(None, "between calls")


def _describe_step(step: Step) -> str:
    kind = "decode" if step.decode else "prefill"
    form = "csr" if step.csr else "padded"
    return (f"{kind} {form} seq_lens={step.seq_lens} q_lens={step.q_lens} Hq={step.num_q_heads} "
            f"{step.query_dtype} {sorted(k for k in step.kw if k not in ('block_tables', 'seq_lens'))}")


def _check_plan(meta: AttentionMetadata, step: Step, backend: str) -> None:
    """A valid plan holds the step as given."""
    what = f"plan_attention {_describe_step(step)}"
    if meta.num_tokens != step.num_tokens or meta.num_seqs != len(step.seq_lens) or meta.is_decode != step.decode:
        raise FuzzFailure(f"{what}: planned {meta.num_tokens} tokens, {meta.num_seqs} sequences, "
                          f"decode={meta.is_decode}")
    if meta.seq_lens.tolist() != step.seq_lens:
        raise FuzzFailure(f"{what}: planned seq_lens {meta.seq_lens.tolist()}")
    tables = meta.block_tables.tolist()
    for i, p in enumerate(step.pages):
        if tables[i][:p] != step.rows[i][:p]:
            raise FuzzFailure(f"{what}: sequence {i}'s blocks planned as {tables[i][:p]}, given {step.rows[i][:p]}")
    if backend != "auto" and meta.backend != backend:
        raise FuzzFailure(f"{what}: planned for backend {meta.backend!r}, forced {backend!r}")
    if "slot_mapping" in step.kw and not torch.equal(meta.slot_mapping.cpu().long(),
                                                     step.kw["slot_mapping"].cpu().long()):
        raise FuzzFailure(f"{what}: the planned slot_mapping differs from the given one")


def api_machine(config: FuzzConfig | None = None) -> type[ApiMachine]:
    """A :class:`ApiMachine` subclass drawing with ``config`` (its ``TestCase`` is a unittest test case)."""
    return type("ApiMachine", (ApiMachine,), {"config": config or FuzzConfig()})
