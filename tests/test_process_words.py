"""The repository describes the library as it is, not how it was made.

Every tracked file (``git ls-files``; binary files skipped) is searched for process words:

* ``session`` as a word or inside a name, in a file's text or in its path (case-insensitive);
* work-item references such as ``issue 12`` or ``issue #12``;
* the narrative words ``A/B`` and ``reverted``;
* in Markdown files, a git commit hash in prose: 7 to 40 hex characters holding both a digit and
  a letter a-f.

A legitimate use goes into ``ALLOWED`` with its reason; keep that list short.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

RULES = {
    "session": re.compile(r"(?i)(?<![a-z])session"),
    "work item": re.compile(r"(?i)\bissues?\s*#?\s*\d+"),
    "A/B": re.compile(r"(?<![\w/])A/Bs?(?![\w/])"),
    "reverted": re.compile(r"(?i)\breverted\b"),
}
COMMIT_HASH = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
PATH_WORD = re.compile(r"(?i)session")

# (path glob, regex removed from that file's text before the search, why it is legitimate)
ALLOWED: list[tuple[str, str, str]] = [
    ("*.py", r"start_new_session", "subprocess.Popen's keyword argument"),
    ("*.py", r"""scope=["']session["']""", "pytest's fixture scope"),
    ("docs/checkpoints.md", r"190900b9", "the vLLM source revision that the k-scale-only rule was read at"),
    ("docs/transformers.md", r"a355f66abfdc", "sha256 prefix of the evaluation text, not a commit"),
]


def tracked_files() -> list[str]:
    """The tracked paths of this checkout, or a skip when this is not one."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"git is not usable here ({exc})")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not the top of a git checkout (an installed copy or an sdist)")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60, check=True)
    return [p for p in listed.stdout.decode("utf-8", "surrogateescape").split("\0")
            if p and p != THIS and not p.startswith(".git/")]


def text_of(path: str) -> str | None:
    """The file's text, with its allowed uses blanked out; None for a binary or absent file."""
    try:
        data = (ROOT / path).read_bytes()
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return None
    if b"\0" in data:
        return None
    text = data.decode("utf-8", "replace")
    for glob, pattern, _why in ALLOWED:
        if fnmatch.fnmatch(path, glob):
            text = re.sub(pattern, lambda m: " " * len(m.group()), text)
    return text


def hits(path: str, text: str, pattern: re.Pattern) -> list[str]:
    found = []
    for m in pattern.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        found.append(f"{path}:{line}: {m.group()!r}")
    return found


def report(found: list[str]) -> str:
    shown = found[:80]
    more = f"\n... and {len(found) - len(shown)} more" if len(found) > len(shown) else ""
    files = sorted({f.split(":", 1)[0] for f in found})
    return f"{len(found)} in {len(files)} files:\n" + "\n".join(shown) + more


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    out = {}
    for path in tracked_files():
        text = text_of(path)
        if text is not None:
            out[path] = text
    return out


@pytest.mark.parametrize("rule", sorted(RULES))
def test_no_process_words_in_tracked_text(texts, rule):
    found = [h for path, text in sorted(texts.items()) for h in hits(path, text, RULES[rule])]
    assert not found, f"process word ({rule}) " + report(found)


def test_no_process_words_in_tracked_paths():
    found = [p for p in tracked_files() if PATH_WORD.search(p)]
    assert not found, "'session' in a tracked path: " + report([f"{p}:0: path" for p in found])


def test_no_commit_hashes_in_markdown(texts):
    found = [h for path, text in sorted(texts.items()) if path.endswith(".md")
             for h in hits(path, text, COMMIT_HASH)]
    assert not found, "commit hash in prose " + report(found)


def test_the_rules_catch_what_they_name():
    """The patterns themselves: each catches its word and leaves ordinary text alone."""
    assert RULES["session"].search("see session25/run1.json") and RULES["session"].search("Session 4")
    assert not RULES["session"].search("a possession")
    assert RULES["work item"].search("issue 12") and RULES["work item"].search("(issue #12)")
    assert not RULES["work item"].search("a known issue with pages")
    assert RULES["A/B"].search("an A/B in one process") and not RULES["A/B"].search("x = a/b")
    assert RULES["reverted"].search("Reverted later") and not RULES["reverted"].search("reverse")
    assert COMMIT_HASH.search("fixed in 1ccb475 then") and COMMIT_HASH.search("at `5d7ba3f`,")
    for word in ("decade", "1234567", "0x80", "e4m3", "fp8_e4m3fnuz", "2026-11-27", "sm_90a"):
        assert not COMMIT_HASH.search(word), word
