"""The hardware CI matrix (ci/): cells as data, claims derived from the registry (a backend's change
changes the matrix with no hand edit), the aggregated report, and the workflow files' consistency."""

from __future__ import annotations

import sys
from pathlib import Path

from fake_backends import TestBackend

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402 - pyproject test extra

from ci import aggregate, cells  # noqa: E402


def test_every_cell_of_the_issue_is_in_the_matrix():
    got = cells.load_cells()
    assert list(got) == ["cpu", "sm70", "sm75", "sm80", "sm86", "sm89", "sm90", "gfx942", "gfx950"]
    assert {c.kind for c in got.values()} == {"cpu", "compile", "run"}
    assert got["sm90"].gpu_tests and got["sm90"].runner == "gpu-h100"


def test_claims_come_from_the_registry(monkeypatch):
    on_h100 = {c.backend for c in cells.claims("sm90")}
    assert {"triton", "hopper", "cuda", "reference"} <= on_h100
    assert {c.backend for c in cells.claims("sm70")} >= {"cuda", "reference"}
    assert "triton" not in {c.backend for c in cells.claims("sm70")}  # needs sm80+
    fp8 = {(c.backend, c.kv_dtype, c.scale_granularity) for c in cells.claims("sm90") if c.mode == "fp8_attention"}
    assert ("hopper", "fp8_e4m3", "head") in fp8 and ("hopper", "fp8_e4m3", "token_head") not in fp8


def test_a_backend_that_changes_its_claims_changes_the_matrix(monkeypatch):
    import fp8kv

    class Extra(TestBackend):
        name, priority = "ci_probe_extra", 5

        @fp8kv.plugins.hookimpl
        def fp8kv_supports(self, device, request):
            return None if device.arch == "sm75" and request.kv_dtype == "fp8_e5m2" else "only e5m2 on sm75"

        @fp8kv.plugins.hookimpl
        def fp8kv_write_kv(self, cache, key, value, slot_mapping):
            raise NotImplementedError

    before = aggregate.render()
    fp8kv.plugins.register_backend(Extra())
    try:
        after = aggregate.render()
    finally:
        fp8kv.plugins.unregister_backend("ci_probe_extra")
    assert "ci_probe_extra" not in before
    rows = [line for line in after.splitlines() if line.startswith("| ci_probe_extra | write_kv")]
    assert rows and all("fp8_e5m2 |" in r for r in rows)
    sm75 = list(cells.load_cells()).index("sm75")
    assert all(r.split(" | ")[5 + sm75].strip() == "claimed" for r in rows)


def test_workflows_are_valid_and_cover_the_matrix():
    matrix = cells.load_cells()
    cpu = yaml.safe_load((ROOT / ".github/workflows/cpu.yml").read_text())
    gpu = yaml.safe_load((ROOT / ".github/workflows/gpu.yml").read_text())
    for wf in (cpu, gpu):
        assert wf["jobs"] and all("steps" in j and "runs-on" in j for j in wf["jobs"].values())
    triggers = cpu[True] if True in cpu else cpu["on"]  # YAML 1.1 reads the key `on` as True
    assert "push" in triggers
    assert "bash .ci/run" in str(cpu["jobs"]["ci"]["steps"])
    listed = set(cpu["jobs"]["cells"]["strategy"]["matrix"]["cell"])
    want = {c.name for c in matrix.values() if c.kind != "run"} | {f"{c.name}-compile" for c in matrix.values()
                                                                   if c.kind == "run" and c.compile}
    assert listed == want
    gtrig = gpu[True] if True in gpu else gpu["on"]
    assert "schedule" in gtrig and "workflow_dispatch" in gtrig
    for c in matrix.values():
        if c.kind == "run":
            job = gpu["jobs"][c.name]
            assert c.runner in job["runs-on"]
            assert f"python -m ci run {c.name} --part gpu" in str(job["steps"])
            if c.gpu_shards > 1:
                assert job["strategy"]["matrix"]["shard"] == list(range(1, c.gpu_shards + 1))
                assert "--shard ${{ matrix.shard }}" in str(job["steps"])


def _record(part: str, passed: bool, shard=None, steps=None) -> dict:
    return {"part": part, "shard": shard, "passed": passed, "timed_out": 0, "budget_s": 560,
            "date": "2026-11-26T00:00:00", "device": {"name": "test"},
            "steps": steps or [{"name": "GPU tests", "rc": 0 if passed else 1, "timed_out": False}]}


def test_gpu_shards_are_pytest_split_groups():
    from ci import runner

    sm90 = cells.load_cells()["sm90"]
    assert sm90.gpu_shards == 2
    args = runner.shard_args(sm90, 2)
    assert args[:4] == ["--splits", "2", "--group", "2"] and "--durations-path" in args
    for bad in (None, 0, 3):
        try:
            runner.shard_args(sm90, bad)
        except SystemExit as exc:
            assert "shard" in str(exc) and "1..2" in str(exc)
        else:
            raise AssertionError(f"shard {bad} accepted")
    assert runner.shard_args(cells.load_cells()["cpu"], None) == []
    assert runner.part_name(sm90, "gpu", 1) == "gpu-1" and runner.part_name(sm90, "compile", None) == "compile"


def test_a_sharded_gpu_part_passes_only_when_every_shard_did(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(aggregate, "REPORTS", tmp_path)
    sm90 = cells.load_cells()["sm90"]
    (tmp_path / "sm90").mkdir()
    (tmp_path / "sm90" / "gpu-1.json").write_text(json.dumps(_record("gpu", True, [1, 2])))
    merged = aggregate._load(sm90)["gpu"]
    assert not merged["passed"] and "shard 2 (no report)" in aggregate._verdict(merged)
    (tmp_path / "sm90" / "gpu-2.json").write_text(json.dumps(_record("gpu", False, [2, 2])))
    assert not aggregate._load(sm90)["gpu"]["passed"]
    (tmp_path / "sm90" / "gpu-2.json").write_text(json.dumps(_record("gpu", True, [2, 2])))
    assert aggregate._load(sm90)["gpu"]["passed"]
    (tmp_path / "sm90" / "gpu.json").write_text(json.dumps(_record("gpu", True)))  # a stale unsharded report
    (tmp_path / "sm90" / "gpu-1.json").unlink()
    assert not aggregate._load(sm90)["gpu"]["passed"]


def test_compile_entries_follow_the_variants_that_serve_each_claim(tmp_path, monkeypatch):
    """A variant that fails (here: e5m2fnuz token-scale attention) fails only the claims it serves."""
    import json

    monkeypatch.setattr(aggregate, "REPORTS", tmp_path)
    sm80 = cells.load_cells()["sm80"]
    (tmp_path / "sm80").mkdir()
    steps = [{"name": "triton kernels (AOT)", "rc": 1, "timed_out": False}]
    (tmp_path / "sm80" / "compile.json").write_text(json.dumps(_record("compile", False, steps=steps)))
    results = [{"kernel": k, "fmt": f, "label": f"{what} {gran} D128", "problems": []}
               for f in cells.FORMATS for gran in ("tensor", "token_head")
               for k, what in (("_decode_kernel", "attn decode"), ("_write_kv_kernel", "write bfloat16"))]
    results += [{"kernel": "_reduce_kernel", "fmt": "-", "label": "reduce D128 token_head", "problems": []}]
    bad = next(r for r in results if r["fmt"] == "fp8_e5m2fnuz" and r["kernel"] == "_decode_kernel"
               and "token_head" in r["label"])
    bad["problems"] = ["412 spill bytes > baseline 0"]
    (tmp_path / "sm80" / "triton_compile.json").write_text(json.dumps({"results": results}))
    parts = aggregate._load(sm80)

    def status(op, fmt, gran):
        claim = cells.Claim("triton", op, "default", fmt, gran, "NHD")
        return aggregate._status(claim, sm80, parts, aggregate._variants(sm80))

    assert status("paged_attention", "fp8_e5m2fnuz", "token_head") == "FAILED"
    assert status("paged_attention", "fp8_e5m2fnuz", "tensor") == "compiled"
    assert status("paged_attention", "fp8_e4m3", "token_head") == "compiled"
    assert status("write_kv", "fp8_e5m2fnuz", "token_head") == "compiled"
    (tmp_path / "sm80" / "triton_compile.json").write_text(json.dumps({"results": [
        r for r in results if r["fmt"] != "fp8_e4m3"]}))
    assert status("paged_attention", "fp8_e4m3", "head") == "FAILED"  # claimed, but never compiled
