"""The README's promises: its test command is what CI runs, and its API example works."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


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


def test_readme_api_example_runs(capsys):
    (example,) = code_blocks("python")
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip() == f"{torch.Size([1, 32, 128])} 0.515625"
