"""The benchmark scripts and their recorded results, on the CPU: every script shows its help, every result
file names its device, versions, date and command and has its plot beside it, and every saved result's
table and plot redraw from the JSON alone."""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = ("write", "decode", "prefill", "decode_sweep", "hf_speed", "hf_precision")
RESULTS = sorted((BENCHMARKS / "results").glob("*.json"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_benchmark_script_shows_its_help(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py", "--help"])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCHMARKS / f"{name}.py"), run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: benchmarks/{name}.py") and "--out" in out and "--plot" in out


def test_the_benchmark_folder_holds_the_scripts_and_one_result_set():
    assert sorted(p.stem for p in BENCHMARKS.glob("*.py")) == sorted(SCRIPTS)
    assert {p.suffix for p in (BENCHMARKS / "results").iterdir()} == {".json", ".png"}


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_each_result_names_its_run_and_has_its_plot(path):
    rec = json.loads(path.read_text())
    assert rec["benchmark"] in SCRIPTS and path.stem.startswith(rec["benchmark"] + "_")
    assert rec["command"] and rec.get("reproduce", rec["command"])
    env = rec["environment"]
    assert env["device"] and env["date"][:4].isdigit()
    assert path.with_suffix(".png").is_file()


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_each_result_redraws_from_its_json(path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from fp8kv_bench import results

    rec = json.loads(path.read_text())
    bench = __import__(f"fp8kv_bench.{rec['benchmark']}", fromlist=["NAME"])
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    assert results.main(bench, ["--plot", str(copy)]) == 0
    assert "|" in capsys.readouterr().out and copy.with_suffix(".png").stat().st_size > 10_000


def test_kernel_benchmarks_refuse_without_cuda(monkeypatch):
    import torch
    from fp8kv_bench import decode, prefill, results, write

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for bench in (write, decode, prefill):
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            results.main(bench, [])


def test_device_tags_name_the_result_files():
    from fp8kv_bench.results import device_tag

    assert device_tag({"device": "NVIDIA H100 80GB HBM3"}) == "h100"
    assert device_tag({"device": "NVIDIA H200"}) == "h200"
    assert device_tag({"device": "NVIDIA A100-SXM4-80GB"}) == "a100"
    assert device_tag({"device": "cpu: AMD EPYC, 2 cores, 2 torch threads"}) == "cpu"
