"""The README's promises: its test command is what CI runs, its API example works, and the
configuration doc it links lists exactly the environment variables fp8kv reads."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import fp8kv.settings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    setup = README.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)
    assert len(commands) == 2
    assert "fp8kv demo" in commands[0]
    test_command = commands[1].split("&&", 1)[1].strip()  # after activating the venv
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()


def section(title: str, text: str = README) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_api_example_runs(capsys):
    (example,) = code_blocks("python")
    assert example in section("Use")
    for call in ("fp8kv.plan_attention(", "fp8kv.write_kv(cache, k, v, meta)", "fp8kv.paged_attention(q, cache, meta)"):
        assert call in example, call  # the plan-once, run-per-layer loop
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip() == f"{torch.Size([40, 32, 128])} 0.515625"


TESTS_ONLY_VARIABLES = {"FP8KV_GPU_EXAMPLES"}  # read by the test suite, never by fp8kv


def test_readme_links_the_configuration_doc():
    assert "(docs/configuration.md)" in README


def test_configuration_doc_lists_every_environment_variable_fp8kv_reads():
    table = section("Environment variables", CONFIGURATION)
    listed = re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", table, flags=re.M)
    assert sorted(listed) == sorted(fp8kv.settings.VARIABLES)
    for name in fp8kv.settings.VARIABLES:
        assert name in fp8kv.settings.__doc__, f"{name} is not in fp8kv/settings.py's table"


def test_readme_names_no_variable_fp8kv_does_not_read():
    named = set(re.findall(r"\bFP8KV_[A-Z0-9_]+", README)) - TESTS_ONLY_VARIABLES
    assert named <= set(fp8kv.settings.VARIABLES), sorted(named - set(fp8kv.settings.VARIABLES))


def test_configuration_doc_names_only_variables_read_by_fp8kv_or_its_tests():
    table = section("Environment variables", CONFIGURATION)  # compile-time macros are named outside it
    named = set(re.findall(r"\bFP8KV_[A-Z0-9_]+", table)) - TESTS_ONLY_VARIABLES
    assert named <= set(fp8kv.settings.VARIABLES), sorted(named - set(fp8kv.settings.VARIABLES))


def test_readme_performance_section_points_to_the_results_doc():
    assert "[docs/performance.md](docs/performance.md)" in section("Performance")


def test_every_result_file_the_docs_cite_exists():
    """README and docs/performance.md name the result file of each figure: each one is in the tree."""
    texts = README + (ROOT / "docs" / "performance.md").read_text()
    cited = set(re.findall(r"benchmarks/results/[\w.-]+\.(?:json|png)", texts))
    cited |= {f"benchmarks/results/{name}" for name in re.findall(r"`([\w-]+_(?:h100|h200|cpu)\.json)`", texts)}
    assert cited, "no result file cited"
    missing = sorted(p for p in cited if not (ROOT / p).is_file())
    assert not missing, missing
