"""One rule per kind of scalar argument, and one rule for environment values (docs/configuration.md).

* float arguments (``softmax_scale``, ``logits_soft_cap``, ``prob_scale``) take Python, NumPy and
  one-element CPU tensor scalars, and become Python floats;
* int arguments (``sliding_window``, ``window_left``, ``num_tokens``, ``max_query_len``,
  ``max_seq_len``, ``max_blocks``) take Python ints, NumPy integers and one-element integer CPU
  tensors, never floats, and become Python ints;
* bools are never numbers; flags (``causal``, ``fp8_attention``, ``validate``) are exactly
  ``True`` or ``False``; a tensor on another device is refused;
* every fp8kv environment variable is stripped, empty means unset, keywords are case-insensitive,
  backend names are kept as written; ``TRITON_INTERPRET`` is read as Triton reads it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fp8kv
from fp8kv import checks, settings
from fp8kv.errors import InvalidArgument

try:  # imported now, under the suite's TRITON_INTERPRET: Triton makes its jit functions once, at import
    from triton._C.libtriton import getenv_bool as triton_getenv_bool
except ImportError:  # no Triton, or one before 3.3 (which reads only TRITON_INTERPRET=1)
    triton_getenv_bool = None

H, GROUP, D, BS, NB = 2, 2, 16, 4, 8
HQ = H * GROUP


@pytest.fixture(scope="module")
def cache() -> fp8kv.KVCache:
    g = torch.Generator().manual_seed(0)
    c = fp8kv.KVCache.allocate(NB, BS, H, D, scale_granularity="head", k_scale=torch.full((H,), 0.05),
                               v_scale=torch.full((H,), 0.05))
    fp8kv.write_kv_one_shot(c, torch.randn(NB * BS, H, D, generator=g), torch.randn(NB * BS, H, D, generator=g),
                            torch.arange(NB * BS), backend="reference")
    return c


TABLES = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
LENS = torch.tensor([9, 6], dtype=torch.int32)
QSL = torch.tensor([0, 3, 5], dtype=torch.int32)


def plan(cache, **kw) -> fp8kv.AttentionMetadata:
    args = dict(num_q_heads=HQ, query_dtype=torch.float32, block_tables=TABLES, seq_lens=LENS, query_start_loc=QSL,
                backend="reference")
    args.update(kw)
    return fp8kv.plan_attention(cache, **args)


# ------------------------------------------------------------------------------ float scalars
FLOAT_FORMS = {
    "python float": lambda v: float(v),
    "np.float16": np.float16,
    "np.float32": np.float32,
    "np.float64": np.float64,
    "0-d tensor": lambda v: torch.tensor(v),
    "[1] float16 tensor": lambda v: torch.tensor([v], dtype=torch.float16),
    "[1, 1] tensor": lambda v: torch.tensor([[v]]),
}
INTEGRAL_FLOAT_FORMS = {"python int": int, "np.int64": np.int64, "np.uint8": np.uint8,
                        "int32 tensor": lambda v: torch.tensor(v, dtype=torch.int32)}
FLOAT_ARGS = {  # argument -> (a value exact in float16, extra plan keywords, where the plan keeps it)
    "softmax_scale": (0.25, {}, lambda m: m.options.softmax_scale),
    "logits_soft_cap": (8.0, {}, lambda m: m.options.logits_soft_cap),
    "prob_scale": (0.5, {"fp8_attention": True}, lambda m: m.options.prob_scale),
}


@pytest.mark.parametrize("form", sorted(FLOAT_FORMS) + sorted(INTEGRAL_FLOAT_FORMS))
@pytest.mark.parametrize("arg", sorted(FLOAT_ARGS))
def test_float_arguments_take_python_numpy_and_cpu_tensor_scalars(cache, arg, form):
    value, extra, kept = FLOAT_ARGS[arg]
    if form in INTEGRAL_FLOAT_FORMS:
        value = 2.0 if arg != "softmax_scale" else 1.0
    make = {**FLOAT_FORMS, **INTEGRAL_FLOAT_FORMS}[form]
    meta = plan(cache, **extra, **{arg: make(value)})
    got = kept(meta)
    assert type(got) is float and got == value
    assert meta.options == plan(cache, **extra, **{arg: value}).options


def _bad_scalars(integer: bool) -> dict[str, object]:
    bad = {
        "bool": True, "np.bool_": np.bool_(True), "str": "1", "None-like list": [1], "complex": 1 + 0j,
        "bool tensor": torch.tensor(True), "two-element tensor": torch.tensor([1, 1]),
        "empty tensor": torch.tensor([], dtype=torch.int64), "meta tensor": torch.ones((), device="meta"),
        "complex tensor": torch.tensor(1 + 0j), "0-d ndarray": np.array(1),
    }
    if integer:
        bad |= {"python float": 4.0, "np.float64": np.float64(4.0), "float tensor": torch.tensor(4.0),
                "half tensor": torch.tensor([4.0], dtype=torch.float16)}
    return bad


@pytest.mark.parametrize("bad", sorted(_bad_scalars(integer=False)))
@pytest.mark.parametrize("arg", sorted(FLOAT_ARGS))
def test_float_arguments_refuse_other_kinds(cache, arg, bad):
    _, extra, _ = FLOAT_ARGS[arg]
    with pytest.raises(InvalidArgument) as err:
        plan(cache, **extra, **{arg: _bad_scalars(integer=False)[bad]})
    assert str(err.value).startswith(arg + ":"), str(err.value)


def test_a_device_tensor_scalar_is_refused_for_the_host_wait_it_would_cost(cache):
    with pytest.raises(InvalidArgument, match="^softmax_scale: .*on meta.*wait for the device"):
        plan(cache, softmax_scale=torch.ones((), device="meta"))
    with pytest.raises(InvalidArgument, match="^sliding_window: .*wait for the device"):
        plan(cache, sliding_window=torch.ones((), dtype=torch.int64, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for a CUDA tensor scalar")
def test_a_cuda_tensor_scalar_is_refused():
    for arg, v in (("softmax_scale", torch.tensor(0.5, device="cuda")),
                   ("sliding_window", torch.tensor(4, device="cuda"))):
        with pytest.raises(InvalidArgument, match=f"^{arg}: .*cuda"):
            checks.positive_float32(arg, v) if arg == "softmax_scale" else checks.int_at_least(arg, v, 1)


def test_a_python_int_past_the_float_range_is_named():
    with pytest.raises(InvalidArgument, match="^softmax_scale:"):
        checks.positive_float32("softmax_scale", 10**400)


# -------------------------------------------------------------------------------- int scalars
INT_FORMS = {
    "python int": int, "np.int64": np.int64, "np.int32": np.int32, "np.uint16": np.uint16,
    "0-d tensor": lambda v: torch.tensor(v), "[1] int32 tensor": lambda v: torch.tensor([v], dtype=torch.int32),
}
INT_ARGS = {  # argument -> (value, extra keywords, where the plan keeps it (None: only accepted), want there)
    "sliding_window": (3, {}, lambda m: m.options.sliding_window, 3),
    "window_left": (2, {}, lambda m: m.options.sliding_window, 3),
    "max_query_len": (3, {}, lambda m: m.max_query_len, 3),
    "max_seq_len": (9, {}, lambda m: m.max_seq_len, 9),
    "num_tokens": (5, {}, lambda m: m.num_tokens, 5),
    "num_q_heads": (HQ, {}, lambda m: m.num_q_heads, HQ),
}


@pytest.mark.parametrize("form", sorted(INT_FORMS))
@pytest.mark.parametrize("arg", sorted(INT_ARGS))
def test_int_arguments_take_python_numpy_and_cpu_integer_tensor_scalars(cache, arg, form):
    value, extra, kept, want = INT_ARGS[arg]
    meta = plan(cache, **extra, **{arg: INT_FORMS[form](value)})
    got = kept(meta)
    assert type(got) is int and got == want
    query = torch.randn(5, HQ, D, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fp8kv.paged_attention(query, cache, meta),
                       fp8kv.paged_attention(query, cache, plan(cache, **extra, **{arg: value})))


@pytest.mark.parametrize("form", ["np.int64", "0-d tensor"])
def test_max_blocks_takes_the_int_scalars(cache, form):
    csr = dict(block_tables=None, seq_lens=None, kv_indptr=torch.tensor([0, 3, 5]), kv_indices=torch.arange(5),
               kv_last_page_len=torch.tensor([1, 2]))
    meta = plan(cache, **csr, max_blocks=INT_FORMS[form](4))
    assert meta.block_tables.shape == (2, 4)


@pytest.mark.parametrize("form", sorted(INT_FORMS))
def test_cache_sizes_take_the_int_scalars(form):
    sizes = [INT_FORMS[form](v) for v in (NB, BS, H, D)]
    c = fp8kv.KVCache.allocate(*sizes)
    assert (c.num_blocks, c.block_size, c.num_kv_heads, c.head_size) == (NB, BS, H, D)
    assert all(type(v) is int for v in (c.num_blocks, c.block_size, c.num_kv_heads, c.head_size))


@pytest.mark.parametrize("name", ["num_blocks", "block_size", "num_kv_heads", "head_size"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, True, torch.tensor(2.0), "2"])
def test_cache_sizes_refuse_what_is_not_a_positive_int(name, bad):
    sizes = dict(num_blocks=NB, block_size=BS, num_kv_heads=H, head_size=D)
    with pytest.raises(InvalidArgument, match=f"^{name}:"):
        fp8kv.KVCache.allocate(**{**sizes, name: bad})


@pytest.mark.parametrize("bad", [1, 0, None, np.bool_(True), torch.tensor(True)])
def test_return_lse_is_a_flag(cache, bad):
    meta = plan(cache)
    with pytest.raises(InvalidArgument, match="^return_lse:"):
        fp8kv.paged_attention(torch.zeros(5, HQ, D), cache, meta, return_lse=bad)


@pytest.mark.parametrize("bad", sorted(_bad_scalars(integer=True)))
@pytest.mark.parametrize("arg", sorted(INT_ARGS) + ["max_blocks"])
def test_int_arguments_refuse_other_kinds(cache, arg, bad):
    with pytest.raises(InvalidArgument) as err:
        plan(cache, **{arg: _bad_scalars(integer=True)[bad]})
    assert str(err.value).startswith(arg + ":"), str(err.value)


def test_the_check_functions_return_plain_python_scalars():
    assert type(checks.nonneg_int("n", np.int64(3))) is int
    assert type(checks.int_at_least("n", torch.tensor([7]), 1)) is int
    assert type(checks.positive_float32("x", np.float32(0.5))) is float
    assert type(checks.real_scalar("x", torch.tensor(3))) is float
    with pytest.raises(InvalidArgument, match="^n: got -1, expected an int >= 0"):
        checks.nonneg_int("n", np.int64(-1))


# ------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("bad", [1, 0, np.bool_(True), torch.tensor(True), "yes", None])
@pytest.mark.parametrize("arg", ["causal", "fp8_attention", "validate"])
def test_flags_are_exactly_true_or_false(cache, arg, bad):
    if arg == "validate" and bad is None:
        assert plan(cache, validate=None).num_tokens == 5  # validate alone may be None (FP8KV_CHECK decides)
        return
    with pytest.raises(InvalidArgument) as err:
        plan(cache, **{arg: bad})
    assert str(err.value).startswith(arg + ":"), str(err.value)


def test_validate_of_a_one_shot_write_is_a_flag_too(cache):
    with pytest.raises(InvalidArgument, match="^validate:"):
        checks.check_slot_mapping(cache.spec, torch.arange(2), 2, 1)


# ------------------------------------------------------------------------- environment values
@pytest.fixture
def env(monkeypatch):
    for var in settings.VARIABLES:
        monkeypatch.delenv(var, raising=False)

    def set_(var: str, value: str) -> None:
        monkeypatch.setenv(var, value)
    return set_


READERS = {  # variable -> (reader, {value: what it reads as}, values it refuses)
    "FP8KV_BACKEND": (settings.forced_backend,
                      {"": None, "  ": None, "auto": None, " AUTO ": None, " reference": "reference",
                       "MyBackend ": "MyBackend"}, ()),
    "FP8KV_AUTO_BACKENDS": (settings.auto_backends,
                            {"": None, " ": None, " , ": None, "Mine": frozenset({"Mine"}),
                             " triton , reference ": frozenset({"triton", "reference"})}, ("auto", " Auto,triton")),
    "FP8KV_STRICT": (settings.strict,
                     {"": False, " ": False, "0": False, " off": False, "No": False, "FALSE": False, " 1 ": True,
                      "True": True, "on": True, "YES": True}, ("2", "maybe", "enable")),
    "FP8KV_CHECK": (settings.check_values, {"": True, " ": True, " full": True, "FULL\n": True, "Shapes": False},
                    ("sometimes", "ful")),
    "FP8KV_SIMULATE_DEVICE": (settings.simulated_device, {"": None, " ": None, " SM90 ": "sm90", "gfx942": "gfx942"},
                              ()),
    "FP8KV_TRITON_CODEC": (settings.triton_codec,
                           {"": "auto", " ": "auto", " Integer ": "integer", "NATIVE": "native"}, ("fast",)),
    "FP8KV_TORCH_NATIVE": (settings.torch_native, {"": True, " ": True, " 0": False, "off": False, "1 ": True,
                                                   "True": True}, ("2", "maybe")),
    "FP8KV_CUDA_ARCH": (settings.cuda_arch, {"": "", " ": "", " SM_75 ": "sm_75", "sm80": "sm80"}, ()),
    "TRITON_INTERPRET": (settings.triton_interpreter,
                         {"": False, "0": False, "1": True, "true": True, "ON": True, "Yes": True, "y": True,
                          " 1": False, "1 ": False, "2": False, "false": False, "off": False}, ()),
}


def test_every_variable_has_a_reading_test():
    assert sorted(READERS) == sorted(settings.VARIABLES)


@pytest.mark.parametrize("var", sorted(READERS))
def test_environment_values_follow_one_rule(env, var):
    reader, reads, refused = READERS[var]
    for value, want in reads.items():
        env(var, value)
        assert reader() == want, (var, value)
    for value in refused:
        env(var, value)
        with pytest.raises(InvalidArgument, match=f"^{var}: got {value!r}"):
            reader()


@pytest.mark.skipif(triton_getenv_bool is None, reason="needs Triton 3.3+ (its getenv_bool)")
def test_triton_interpret_is_read_as_triton_reads_it(env):
    for value in ("", "0", "1", "true", "TRUE", "on", "yes", "y", "Y", " 1", "1 ", "2", "t", "false", "off"):
        env("TRITON_INTERPRET", value)
        assert settings.triton_interpreter() == triton_getenv_bool("TRITON_INTERPRET", False), repr(value)


@pytest.mark.parametrize("form", sorted(FLOAT_FORMS))
def test_a_layer_prob_scale_follows_the_float_rule(cache, form):
    meta = plan(cache, fp8_attention=True)
    query = torch.randn(5, HQ, D, generator=torch.Generator().manual_seed(2))
    got = fp8kv.paged_attention(query, cache, meta, layer_scales={"prob_scale": FLOAT_FORMS[form](0.5)})
    want = fp8kv.paged_attention(query, cache, meta, layer_scales={"prob_scale": 0.5})
    assert torch.equal(got, want)
    with pytest.raises(InvalidArgument, match="^layer_scales: got prob_scale"):
        fp8kv.paged_attention(query, cache, meta, layer_scales={"prob_scale": FLOAT_FORMS[form](0.0)})
