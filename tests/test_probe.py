"""The capability probe (real and simulated devices) and the ``fp8kv probe`` command."""

from __future__ import annotations

import json

import pytest
import torch

import fp8kv
import fp8kv.registry as registry_mod
from fp8kv import reference
from fp8kv.cli import main
from fp8kv.plugins import BackendInfo, hookimpl
from fp8kv.probe import SIMULATED, probe, simulate_device, simulated
from fp8kv.registry import Registry, register_backend

EXPECTED = {  # arch: (vendor, native FP8, triton, cupy, fp8 alias)
    "cpu": ("cpu", set(), False, False, "fp8_e4m3"),
    "sm70": ("nvidia", set(), False, True, "fp8_e4m3"),
    "sm75": ("nvidia", set(), False, True, "fp8_e4m3"),
    "sm80": ("nvidia", set(), True, True, "fp8_e4m3"),
    "sm86": ("nvidia", set(), True, True, "fp8_e4m3"),
    "sm89": ("nvidia", {"fp8_e4m3", "fp8_e5m2"}, True, True, "fp8_e4m3"),
    "sm90": ("nvidia", {"fp8_e4m3", "fp8_e5m2"}, True, True, "fp8_e4m3"),
    "gfx942": ("amd", {"fp8_e4m3fnuz", "fp8_e5m2fnuz"}, True, False, "fp8_e4m3fnuz"),
    "gfx950": ("amd", {"fp8_e4m3", "fp8_e5m2"}, True, False, "fp8_e4m3"),
}


def test_every_documented_device_can_be_simulated():
    assert set(SIMULATED) == set(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_simulated_devices(name, monkeypatch):
    vendor, native, triton, cupy, alias = EXPECTED[name]
    monkeypatch.setenv("FP8KV_SIMULATE_DEVICE", name)
    info = probe()
    assert (info.vendor, set(info.native_fp8), info.triton, info.cupy, info.fp8_alias) == \
        (vendor, native, triton, cupy, alias)
    assert info.simulated and info.arch == (None if name == "cpu" else name)
    assert info.is_gpu == (name != "cpu") and info.device_type == ("cpu" if name == "cpu" else "cuda")
    assert info.sm == (int(name[2:]) if name.startswith("sm") else None)
    assert probe("cpu") is info  # simulation wins over an explicit device
    assert fp8kv.KVCache.allocate(1, 1, 1, 16, kv_dtype="fp8").kv_dtype == alias


def test_simulate_device_context_nests_overrides_and_restores(monkeypatch):
    monkeypatch.delenv("FP8KV_SIMULATE_DEVICE", raising=False)
    real = probe()
    with simulate_device("sm80") as outer:
        assert probe() is outer and outer.arch == "sm80"
        with simulate_device("sm90", cupy=False) as inner:
            assert probe() == inner and inner.arch == "sm90" and not inner.cupy
        assert probe() is outer
        monkeypatch.setenv("FP8KV_SIMULATE_DEVICE", "gfx942")
        assert probe() is outer  # the context manager wins over the environment
    assert probe().arch == "gfx942"
    monkeypatch.delenv("FP8KV_SIMULATE_DEVICE")
    assert probe() == real


def test_unknown_simulated_device_is_an_error(monkeypatch):
    with pytest.raises(fp8kv.Fp8KVError, match=r"got 'sm99', expected one of \['cpu', 'sm70'"):
        with simulate_device("sm99"):
            pass
    with pytest.raises(fp8kv.Fp8KVError, match="unknown fields"):
        with simulate_device("sm80", tensor_cores=True):
            pass
    monkeypatch.setenv("FP8KV_SIMULATE_DEVICE", "h100")
    with pytest.raises(fp8kv.Fp8KVError, match="FP8KV_SIMULATE_DEVICE"):
        probe()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU probe")
def test_real_cpu_probe_is_cached_and_follows_the_interpreter_setting(monkeypatch):
    monkeypatch.delenv("FP8KV_SIMULATE_DEVICE", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    info = probe()
    assert info is probe("cpu") is probe(torch.device("cpu"))
    assert (info.vendor, info.arch, info.simulated, info.triton, info.native_fp8) == \
        ("cpu", None, False, False, frozenset())
    assert info.memory_bytes > 0 and info.name
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert probe().triton  # triton is a test dependency
    assert "triton (interpreter)" in probe().describe()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_gpu_probe_matches_torch():
    info = probe()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert info.is_gpu and not info.simulated and info.memory_bytes == props.total_memory
    if not torch.version.hip:
        assert info.arch == f"sm{props.major}{props.minor}"


# -- the CLI -----------------------------------------------------------------------------


class FastE4M3:
    """A fast backend for the table: e4m3 only, sm89+ only."""

    @hookimpl
    def fp8kv_backend_info(self):
        return BackendInfo("fast_e4m3", "2.0", priority=100, description="test: e4m3 on sm89+")

    @hookimpl
    def fp8kv_supports(self, device, request):
        if request.kv_dtype != "fp8_e4m3":
            return f"{request.kv_dtype} is not implemented"
        if (device.sm or 0) < 89:
            return f"{device.arch or device.vendor}: needs native FP8 (sm89+)"
        return None

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        reference.write_kv(cache, key, value, slot_mapping)


def test_probe_command_with_only_the_reference_explains_the_small_table(isolated, capsys):
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device: ") and "'fp8' means fp8_e4m3 here" in out
    assert f"reference  {fp8kv.__version__}  priority 0  slow  from fp8kv" in out
    assert "reference  write_kv         ✓         ✓         ✓             ✓" in out
    assert "paged_attention  reference (slow)  reference (slow)" in out
    assert "Only slow backends are installed (reference)" in out
    assert "On the CPU a slow backend is the expected one" in out
    assert "faults" not in out


def test_probe_command_simulated_sm80_gives_every_reason_and_the_pick(isolated, capsys):
    register_backend(FastE4M3(), distribution="fast-e4m3")
    assert main(["probe", "--simulate", "sm80"]) == 0
    out = capsys.readouterr().out
    assert "device: A100 (simulated) [nvidia, sm80]; native FP8 conversions: none" in out
    assert "bfloat16 on cuda" in out
    lines = out.splitlines()
    row = next(ln for ln in lines if ln.strip().startswith("fast_e4m3  write_kv"))
    assert row.split()[2:] == ["✗", "[1]", "✗", "[2]", "✗", "[3]", "✗", "[4]"]
    attn = next(ln for ln in lines if ln.strip().startswith("fast_e4m3  paged_attention"))
    assert "[5]" in attn  # no attention hook: its own reason
    assert "  [1] sm80: needs native FP8 (sm89+)" in lines
    assert "  [2] fp8_e5m2 is not implemented" in lines
    assert "  [5] does not implement fp8kv_paged_attention" in lines
    assert "write_kv         reference (slow)" in out
    assert "warns once per request" in out


def test_probe_command_simulated_sm90_picks_the_fast_backend(isolated, capsys):
    register_backend(FastE4M3(), distribution="fast-e4m3")
    assert main(["probe", "--simulate", "sm90"]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("write_kv "))
    assert row.split()[1:3] == ["fast_e4m3", "reference"]


def test_probe_command_json(isolated, capsys):
    register_backend(FastE4M3(), distribution="fast-e4m3")
    assert main(["probe", "--simulate", "gfx942", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"]["arch"] == "gfx942" and report["fp8_alias"] == "fp8_e4m3fnuz"
    assert [b["name"] for b in report["backends"]] == ["fast_e4m3", "reference"]
    assert len(report["support"]) == 2 * 2 * 4  # backends x ops x formats
    cell = next(s for s in report["support"] if s["backend"] == "fast_e4m3" and s["kv_dtype"] == "fp8_e4m3"
                and s["op"] == "write_kv")
    assert cell == {"backend": "fast_e4m3", "op": "write_kv", "kv_dtype": "fp8_e4m3", "ok": False,
                    "reason": "gfx942: needs native FP8 (sm89+)"}
    assert {a["backend"] for a in report["auto"]} == {"reference"} and report["faults"] == []


@pytest.mark.parametrize("name", list(SIMULATED))
def test_probe_command_on_every_simulated_device(name, capsys):
    """With whatever is installed here: a table, a pick for every cell, and no crash."""
    assert main(["probe", "--simulate", name]) == 0
    out = capsys.readouterr().out
    assert f"device: {simulated(name).name}" in out
    for backend in fp8kv.available_backends():
        assert f"  {backend} " in out
    picks = [ln for ln in out.split("auto picks:")[1].splitlines()[2:4]]
    assert all(len(ln.split()) >= 5 for ln in picks)


def test_probe_command_shows_faults_and_the_forced_backend(isolated, capsys, monkeypatch):
    class Broken(FastE4M3):
        @hookimpl
        def fp8kv_supports(self, device, request):
            raise KeyError("arch table")

    register_backend(Broken(), distribution="broken-dist")
    monkeypatch.setenv("FP8KV_BACKEND", "reference")
    with pytest.warns(RuntimeWarning, match="raised in fp8kv_supports"):
        assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert "faults (these plugins are skipped or treated as refusing):" in out
    assert "fast_e4m3 (broken-dist) raised in fp8kv_supports: KeyError: 'arch table'" in out
    assert "fp8kv_supports raised KeyError: 'arch table'" in out
    assert "but FP8KV_BACKEND=reference forces that backend on every call" in out


def test_probe_command_rejects_unknown_simulation(capsys):
    with pytest.raises(SystemExit):
        main(["probe", "--simulate", "sm99"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_probe_command_on_simulated_amd_picks_triton_and_says_it_was_not_run(arch, capsys, monkeypatch):
    """The ROCm path: the Triton backend serves every format on gfx942/gfx950 (outside the
    interpreter), and the probe says it was compiled for that arch, not run on AMD hardware."""
    pytest.importorskip("triton")
    from fp8kv_triton.plugin import TritonBackend

    reg = Registry(loaded=True)
    reg.add(reference.ReferenceBackend(), distribution="fp8kv")
    reg.add(TritonBackend(), distribution="fp8kv")
    monkeypatch.setattr(registry_mod, "_REGISTRY", reg)
    for var in ("FP8KV_BACKEND", "FP8KV_SIMULATE_DEVICE", "FP8KV_AUTO_BACKENDS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert main(["probe", "--simulate", arch]) == 0
    out = capsys.readouterr().out
    rows = out.split("auto picks:")[1].splitlines()[2:4]
    assert [r.split()[1:] for r in rows] == [["triton"] * 4] * 2
    assert f"compiled for {arch}, not run on AMD hardware" in out
    assert "triton on this device:" in out and "fp8_e4m3fnuz: encode integer bits, decode integer bits" in out
    assert "NVIDIA GPUs only" not in out
    assert main(["probe", "--simulate", "sm90", "--json"]) == 0  # NVIDIA: no AMD notes
    assert json.loads(capsys.readouterr().out)["device_notes"] == {}
