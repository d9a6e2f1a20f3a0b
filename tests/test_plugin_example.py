"""The example plugin of docs/plugins.md, built as a separate distribution in a temporary
directory (its module plus a ``*.dist-info`` with METADATA and entry_points.txt, put on
``sys.path``): discovered through the entry point, selected by priority, forced by name,
explained in ``fp8kv probe``, passing the conformance kit. Plus the fault cases: a plugin
that fails to import (SystemExit and KeyboardInterrupt included) or raises in a hook is
reported and skipped and the built-in backends still load, a plugin claiming a built-in
name is refused, of two distributions with one backend name the first is kept and the
second reported naming both, a backend that claims and fails is named."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fp8kv
import fp8kv.registry as registry_mod
from fp8kv.cli import main
from fp8kv.plugins import Request
from fp8kv.reference import ReferenceBackend
from fp8kv.registry import (
    RESERVED_NAMES,
    BackendFailure,
    available_backends,
    faults,
    registry,
    reset_registry,
    select_backend,
    unregister_backend,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def doc_files() -> dict[str, str]:
    """The files of the documented example: ``<!-- example-file: path -->`` + a fenced block."""
    text = DOC.read_text()
    return dict(re.findall(r"<!-- example-file: (\S+) -->\n```\w*\n(.*?)```", text, re.S))


def entry_points_of(pyproject: str) -> dict[str, str]:
    """The ``fp8kv.backends`` entry points declared in a pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads(pyproject)["project"]["entry-points"]["fp8kv.backends"]


class Site:
    """A directory on ``sys.path`` holding 'installed' distributions (module + dist-info)."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: list[str] = []
        root.mkdir()
        sys.path.insert(0, str(root))

    def install(self, dist: str, module: str, code: str, entry_points: dict[str, str],
                version: str = "0.1.0") -> None:
        (self.root / f"{module}.py").write_text(code)
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        eps = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (info / "entry_points.txt").write_text(f"[fp8kv.backends]\n{eps}")
        (info / "top_level.txt").write_text(module + "\n")
        self.modules.append(module)

    def close(self) -> None:
        sys.path.remove(str(self.root))
        for m in self.modules:
            sys.modules.pop(m, None)


@pytest.fixture
def site(tmp_path, monkeypatch):
    for var in ("FP8KV_BACKEND", "FP8KV_AUTO_BACKENDS", "FP8KV_STRICT", "FP8KV_SIMULATE_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    s = Site(tmp_path / "site")
    yield s
    s.close()
    reset_registry()  # back to what is really installed


def install_example(site: Site) -> None:
    files = doc_files()
    code = files["src/fp8kv_example/__init__.py"]
    site.install("fp8kv-example", "fp8kv_example", code, entry_points_of(files["pyproject.toml"]))


def fresh_registry(keep=("reference", "example")):
    """Re-read the entry points; drop other installed backends so the outcome does not depend on them."""
    reset_registry()
    for name in list(available_backends()):
        if name not in keep:
            unregister_backend(name)
    return registry()


def req(kv_dtype="fp8_e4m3", layout="NHD", op="write_kv") -> Request:
    return Request(op, kv_dtype, layout, "tensor", 64, torch.float32, "cpu")


def test_the_doc_declares_a_complete_example():
    files = doc_files()
    assert set(files) == {"src/fp8kv_example/__init__.py", "pyproject.toml", "tests/test_conformance.py"}
    assert entry_points_of(files["pyproject.toml"]) == {"example": "fp8kv_example:ExampleBackend"}


def test_example_is_discovered_and_selected_by_priority(site):
    install_example(site)
    fresh_registry()
    b = available_backends()["example"]
    assert (b.distribution, b.info.version, b.info.priority) == ("fp8kv-example", "0.1.0", 10)
    sel = select_backend(req(), "cpu")
    assert sel.backend.name == "example"
    assert sel.reasons == {"reference": "can serve, lower priority than example"}
    sel = select_backend(req(layout="HND"), "cpu")
    assert sel.backend.name == "reference"
    assert sel.reasons == {"example": "layout HND: only NHD is implemented"}
    # through the API: auto picks it for an NHD cache
    cache = fp8kv.KVCache.allocate(4, 4, 2, 16, kv_dtype="fp8_e5m2", k_scale=0.01, v_scale=0.02)
    slots = torch.tensor([3, -1, 7])
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    fp8kv.write_kv_one_shot(cache, k, v, slots)
    want = fp8kv.KVCache.allocate(4, 4, 2, 16, kv_dtype="fp8_e5m2", k_scale=0.01, v_scale=0.02)
    fp8kv.write_kv_one_shot(want, k, v, slots, backend="reference")
    assert cache.same_bytes(want)


def test_example_is_forced_by_name(site, monkeypatch):
    install_example(site)
    fresh_registry()
    assert select_backend(req(), "cpu", backend="reference").backend.name == "reference"
    monkeypatch.setenv("FP8KV_BACKEND", "example")
    sel = select_backend(req(), "cpu")
    assert sel.backend.name == "example" and sel.forced
    cache = fp8kv.KVCache.allocate(2, 4, 1, 16, kv_dtype="fp8_e4m3fnuz")
    with pytest.raises(fp8kv.Fp8KVError, match="backend 'example' cannot serve write_kv fp8_e4m3fnuz .*: "
                       "fp8_e4m3fnuz: only the OCP formats are implemented"):
        fp8kv.write_kv_one_shot(cache, torch.ones(1, 1, 16), torch.ones(1, 1, 16), torch.tensor([0]))


def test_example_is_explained_in_fp8kv_probe(site, capsys):
    install_example(site)
    fresh_registry()
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert "example    0.1.0  priority 10  slow  from fp8kv-example  minimal example plugin" in out
    lines = out.splitlines()
    row = next(ln for ln in lines if ln.strip().startswith("example    write_kv"))
    assert row.split()[2:] == ["✓", "✓", "✗", "[1]", "✗", "[2]"]
    assert "  [1] fp8_e4m3fnuz: only the OCP formats are implemented" in lines
    pick = next(ln for ln in lines if ln.strip().startswith("paged_attention  example"))
    assert pick.split() == ["paged_attention", *["example", "(slow)"] * 2, *["reference", "(slow)"] * 2]


def test_example_passes_the_conformance_kit_as_documented(site):
    install_example(site)
    fresh_registry()
    namespace: dict = {}
    exec(doc_files()["tests/test_conformance.py"], namespace)  # the test a plugin author would write
    namespace["test_example_backend_conforms"]()


# -- faults (issue item 7) ------------------------------------------------------------------

GOOD = '''
from fp8kv.plugins import BackendInfo, hookimpl
from fp8kv.reference import ReferenceBackend

class Good(ReferenceBackend):
    @hookimpl
    def fp8kv_backend_info(self):
        return BackendInfo("{name}", "1", priority=5, fast=False)
'''


def test_a_plugin_that_fails_to_import_is_reported_and_skipped(site, capsys):
    install_example(site)
    site.install("fp8kv-broken", "fp8kv_broken", "raise ImportError('needs libfoo.so')\n",
                 {"broken": "fp8kv_broken:Backend"})
    with pytest.warns(RuntimeWarning, match=r"backend plugin broken \(fp8kv-broken\) failed to load: "
                      "ImportError: needs libfoo.so; it was skipped"):
        fresh_registry(keep=("reference", "example", "broken"))
    assert set(available_backends()) == {"example", "reference"}
    assert [(f.name, f.distribution, f.where) for f in faults()] == [("broken", "fp8kv-broken", "load")]
    assert select_backend(req(), "cpu").backend.name == "example"  # the others are unaffected
    with pytest.raises(fp8kv.Fp8KVError, match="'broken' is installed but failed to load: ImportError"):
        select_backend(req(), "cpu", backend="broken")
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert "broken (fp8kv-broken) failed to load: ImportError: needs libfoo.so" in out


def test_invalid_plugins_from_entry_points_are_faults_not_fatal(site):
    site.install("fp8kv-typo", "fp8kv_typo", GOOD.format(name="typo") + '''
    @hookimpl
    def fp8kv_suports(self, device, request):
        return None
''', {"typo": "fp8kv_typo:Good"})
    site.install("fp8kv-noinfo", "fp8kv_noinfo", "class Empty:\n    pass\n", {"noinfo": "fp8kv_noinfo:Empty"})
    site.install("fp8kv-good", "fp8kv_good", GOOD.format(name="good"), {"good": "fp8kv_good:Good"})
    with pytest.warns(RuntimeWarning) as caught:
        fresh_registry(keep=("reference", "good"))
    messages = " | ".join(str(w.message) for w in caught)
    assert "typo (fp8kv-typo) failed to load: PluginValidationError" in messages
    assert "noinfo (fp8kv-noinfo) failed to load: TypeError" in messages
    assert set(available_backends()) == {"good", "reference"}


def test_a_plugin_raising_in_a_hook_is_reported_and_skipped(site, capsys):
    install_example(site)
    code = GOOD.format(name="raises").replace("priority=5", "priority=50")
    site.install("fp8kv-raises", "fp8kv_raises", code + '''
    @hookimpl
    def fp8kv_supports(self, device, request):
        raise RuntimeError("capability table is corrupt")
''', {"raises": "fp8kv_raises:Good"})
    fresh_registry(keep=("reference", "example", "raises"))
    with pytest.warns(RuntimeWarning, match=r"raises \(fp8kv-raises\) raised in fp8kv_supports: Runtime"):
        sel = select_backend(req(), "cpu")
    assert sel.backend.name == "example"
    assert sel.reasons["raises"] == "fp8kv_supports raised RuntimeError: capability table is corrupt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert "raises (fp8kv-raises) raised in fp8kv_supports: RuntimeError: capability table is corrupt" in out


def write_one(**kw) -> None:
    fp8kv.write_kv_one_shot(fp8kv.KVCache.allocate(1, 1, 1, 16), torch.ones(1, 1, 16), torch.ones(1, 1, 16),
                   torch.tensor([0]), **kw)


def test_two_distributions_with_one_backend_name_keep_the_first_and_report_both(site, capsys):
    site.install("fp8kv-dup-one", "fp8kv_dup_one", GOOD.format(name="dup"), {"dup": "fp8kv_dup_one:Good"})
    site.install("fp8kv-dup-two", "fp8kv_dup_two", GOOD.format(name="dup"), {"dup2": "fp8kv_dup_two:Good"})
    both = ("two backends are named 'dup': the one from the distribution 'fp8kv-dup-one' (registered first) is "
            "kept, the one from 'fp8kv-dup-two' is refused; uninstall or rename one")
    with pytest.warns(RuntimeWarning, match=re.escape(f"dup2 (fp8kv-dup-two) failed to load: "
                                                      f"DuplicateBackendError: {both}")):
        fresh_registry(keep=("reference", "dup"))
    assert available_backends()["dup"].distribution == "fp8kv-dup-one"
    assert [(f.name, f.distribution) for f in faults()] == [("dup2", "fp8kv-dup-two")]
    for _ in range(2):  # no call is broken by it
        write_one()
        write_one(backend="dup")
    assert main(["probe"]) == 0
    assert f"dup2 (fp8kv-dup-two) failed to load: DuplicateBackendError: {both}" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(RESERVED_NAMES))
def test_a_distribution_claiming_a_builtin_name_is_refused_and_the_builtin_stays(site, name):
    code = GOOD.format(name=name).replace("priority=5", "priority=1000")
    site.install("fp8kv-impostor", "fp8kv_impostor", code, {"impostor": "fp8kv_impostor:Good"})
    with pytest.warns(RuntimeWarning, match=rf"impostor \(fp8kv-impostor\) failed to load: ReservedNameError: "
                      rf"backend name '{name}' is reserved for fp8kv's built-in backend"):
        reset_registry()
        backends = available_backends()
    assert backends["reference"].distribution == "fp8kv"
    if name in backends:  # the built-in triton is there whenever it imports here
        assert backends[name].distribution == "fp8kv"
    assert all(b.distribution == "fp8kv" for b in backends.values())
    assert [(f.name, f.distribution) for f in faults()] == [("impostor", "fp8kv-impostor")]
    for _ in range(2):
        write_one()
        write_one(backend="reference")


RAISES_AT_IMPORT = {
    "SystemExit": "import sys\nsys.exit('no GPU, bye')\n",
    "GeneratorExit": "raise GeneratorExit('odd')\n",
    "BaseException": "raise BaseException('plain')\n",
}


@pytest.mark.parametrize("kind", sorted(RAISES_AT_IMPORT))
def test_a_plugin_raising_a_base_exception_at_import_is_reported_and_the_rest_load(site, kind):
    install_example(site)
    # "aaa" sorts before every other entry point: the built-ins still load, and so does "example"
    site.install("fp8kv-exits", "fp8kv_exits", RAISES_AT_IMPORT[kind], {"aaa": "fp8kv_exits:Backend"})
    with pytest.warns(RuntimeWarning, match=rf"aaa \(fp8kv-exits\) failed to load: {kind}"):
        fresh_registry(keep=("reference", "example", "aaa"))
    assert set(available_backends()) == {"example", "reference"}
    assert [(f.name, f.distribution, f.where) for f in faults()] == [("aaa", "fp8kv-exits", "load")]
    assert select_backend(req(), "cpu").backend.name == "example"


def test_a_plugin_raising_keyboard_interrupt_at_import_leaves_a_registry_the_next_call_completes(site):
    install_example(site)
    site.install("fp8kv-interrupts", "fp8kv_interrupts", "raise KeyboardInterrupt\n",
                 {"aaa": "fp8kv_interrupts:Backend"})
    reset_registry()
    with pytest.raises(KeyboardInterrupt), pytest.warns(RuntimeWarning, match="aaa .* KeyboardInterrupt"):
        registry()  # the interrupt propagates ...
    reg = registry_mod._REGISTRY
    assert not reg.loaded and "reference" in reg.backends  # ... after the built-ins, before "example"
    assert "example" not in reg.backends
    names = set(available_backends())  # the next call goes on where it stopped
    assert {"reference", "example"} <= names and "aaa" not in names and reg.loaded
    [fault] = faults()
    assert (fault.name, fault.distribution) == ("aaa", "fp8kv-interrupts")
    assert fault.error == "KeyboardInterrupt (interrupted while loading; skipped until reset_registry())"
    assert select_backend(req(), "cpu", backend="example").backend.name == "example"
    write_one()


def test_an_interrupted_builtin_is_loaded_by_the_next_call(site, monkeypatch):
    interrupts = [KeyboardInterrupt()]

    def init(self):
        if interrupts:
            raise interrupts.pop()

    monkeypatch.setattr(ReferenceBackend, "__init__", init, raising=False)
    reset_registry()
    with pytest.raises(KeyboardInterrupt):
        registry()
    assert "reference" in available_backends()  # retried, not skipped
    assert not [f for f in faults() if f.name == "reference"]


def test_system_exit_in_an_installed_plugins_support_check_does_not_escape_write_kv(site):
    code = GOOD.format(name="quits").replace("priority=5", "priority=50")
    site.install("fp8kv-quits", "fp8kv_quits", code + '''
    @hookimpl
    def fp8kv_supports(self, device, request):
        raise SystemExit(1)
''', {"quits": "fp8kv_quits:Good"})
    fresh_registry(keep=("reference", "quits"))
    with pytest.warns(RuntimeWarning, match=r"quits \(fp8kv-quits\) raised in fp8kv_supports: SystemExit: 1"):
        write_one()
    write_one()
    assert select_backend(req(), "cpu").backend.name == "reference"


def test_an_installed_backend_that_claims_and_fails_is_named(site):
    code = GOOD.format(name="liar").replace("priority=5", "priority=50")
    site.install("fp8kv-liar", "fp8kv_liar", code + '''
    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        raise IndexError("block table out of range")
''', {"liar": "fp8kv_liar:Good"})
    fresh_registry(keep=("reference", "liar"))
    with pytest.raises(BackendFailure, match=r"backend 'liar' \(fp8kv-liar\) claimed support and failed in "
                       "fp8kv_write_kv: IndexError: block table out of range"):
        fp8kv.write_kv_one_shot(fp8kv.KVCache.allocate(1, 1, 1, 16), torch.ones(1, 1, 16), torch.ones(1, 1, 16),
                       torch.tensor([0]))


# -- the real packaging route -------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build")
def test_the_documented_pyproject_builds_and_installs(tmp_path):
    """pip builds the documented source tree (no network: no deps, no build isolation)."""
    src = tmp_path / "fp8kv-example"
    for path, text in doc_files().items():
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_text(text)
    target = tmp_path / "target"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(target), str(src)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    sys.path.insert(0, str(target))
    try:
        reset_registry()
        assert available_backends()["example"].distribution == "fp8kv-example"
    finally:
        sys.path.remove(str(target))
        sys.modules.pop("fp8kv_example", None)
        reset_registry()
