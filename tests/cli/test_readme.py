"""The README a newcomer reads (issue 42, item 5): one screen of what Ballast is, two commands, a tour, the
picture, links. Held here: its length, every link in it and in docs/ resolving (files and headings), and every
command in the shell blocks of it and of docs/ being one the project has -- each `ballast …` line parsed by the
CLI's own parser, each `make` target in the Makefile, each file it names present. The tour's commands also run
for real: the demo and up/status/sql/plan/explain/down (tests/cli/test_main.py), "Your own model"
(test_user_models_e2e.py), "Your data, your weights" (test_weights_e2e.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ballast.cli.main import build_parser
from tests.harness import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = 250
FENCE = re.compile(r"```bash\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def commands(text: str) -> list[list[str]]:
    """Each command line of the text's bash blocks as words: continuations joined, comments and `VAR=…` dropped."""
    found = []
    for block in FENCE.findall(text):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += ("\n" if pending else "") + line
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on on the next line
                continue
            pending = ""
            if words:
                found.append(words)
        assert not pending, f"an unclosed quote in a README block: {pending}"
    return found


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_the_readme_fits_one_sitting():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= MAX_LINES


@pytest.mark.parametrize("page", [*PAGES, ROOT / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_every_link_resolves_to_a_file_and_heading_of_the_repository(page: Path):
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.is_relative_to(ROOT), f"{page.name}: {target} points outside the repository"
        assert path.exists(), f"{page.name}: {target} does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{page.name}: {target}: no such heading in {path.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_in_a_page_is_one_the_project_has(page: Path):
    """A shell block is what a reader pastes: each line must run (a usage synopsis goes in a ```text fence)."""
    parser = build_parser()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), flags=re.M))
    for words in commands(page.read_text(encoding="utf-8")):
        head, args = words[0], words[1:]
        if head == "ballast":
            parser.parse_args(args)  # SystemExit (a usage error) fails the test, naming the line
        elif head == "make":
            assert set(args) <= targets, args
        elif head == "export":
            assert all("=" in a for a in args), words
        elif head == "source":
            assert args == [".venv/bin/activate"], words
        else:
            pytest.fail(f"{page.name} runs {head!r}: add it here with a check, or keep to ballast and make")
        for arg in args:
            if arg.startswith(("examples/", "docs/")):
                assert (ROOT / arg).exists(), f"{' '.join(words)}: {arg} does not exist"


def test_the_readme_shows_both_make_commands_and_the_cli():
    heads = {words[0] for words in commands(README.read_text(encoding="utf-8"))}
    assert {"ballast", "make", "source", "export"} == heads


def test_the_parser_check_catches_a_command_the_cli_does_not_have():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["submit", "examples/gpt-tiny.yaml", "--no-such-flag"])


def test_every_cli_command_has_a_row_in_the_user_guides_table():
    import argparse

    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    guide = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    assert [name for name in subcommands if f"| `ballast {name}" not in guide] == []
