"""The docs stay true: docs/cli.md's generated part is the parser's, every relative link and anchor in README.md and
docs/ resolves, the README stays a short page with the install and test commands CI runs, and no data files live in
the package.

`python -m tests.unit.test_docs` rewrites docs/cli.md's generated part (above MARKER) from codespec.cli.options.build_parser();
what is below the marker is written by hand and kept."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLI_DOC = DOCS / "cli.md"
MARKER = "<!-- end of generated part -->"
REGENERATE = "python -m tests.unit.test_docs"
README_MAX_LINES = 200
INSTALL = 'pip install torch==2.13.0 -e ".[test]"'  # .ci/run installs and tests with exactly these lines
TEST = "pytest"
DATA_SUFFIXES = (".json", ".png", ".txt", ".log", ".csv")
RUNTIME_DATA: frozenset[str] = frozenset()  # data files a module under codespec/ loads at runtime: none today


# --- docs/cli.md from the parser -----------------------------------------------------------------------------------


@contextmanager
def environment_free_defaults():
    """Some defaults come from the environment (`--api-key` from $CODESPEC_API_KEY, `--ray-address` from $RAY_ADDRESS):
    build the parser without them, so the page never depends on the shell, nor shows a key."""
    source = "".join(path.read_text() for path in sorted((ROOT / "codespec" / "cli").glob("*.py")))
    names = set(re.findall(r"""os\.environ\.get\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']""", source))
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def expand_help(action: argparse.Action, prog: str) -> str:
    """The help text with %(default)s and the like expanded as argparse's HelpFormatter._expand_help does."""
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    params = dict(vars(action), prog=prog)
    params = {name: value for name, value in params.items() if value is not argparse.SUPPRESS}
    params = {name: getattr(value, "__name__", value) for name, value in params.items()}
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(choice) for choice in params["choices"])
    return action.help % params


def metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        name = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        name = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        name = action.dest.upper()
    if action.nargs == "?":
        return f"[{name}]"
    if action.nargs == "+":
        return f"{name} [{name} ...]"
    if action.nargs == "*":
        return f"[{name} ...]"
    if isinstance(action.nargs, int) and action.nargs > 1:
        return " ".join([name] * action.nargs)
    return name


def invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{metavar(action)}`"
    if action.nargs == 0:
        return ", ".join(f"`{option}`" for option in action.option_strings)
    return ", ".join(f"`{option} {metavar(action)}`" for option in action.option_strings)


def default_cell(action: argparse.Action) -> str:
    default = action.default
    if default is None or default is argparse.SUPPRESS or action.nargs == 0 or default == ():
        return ""
    if isinstance(default, (list, tuple)):
        default = ",".join(str(item) for item in default)
    return f"`{default}`"


def cell(text: str) -> str:
    """Text for a table cell: no line breaks, and |, * and < taken literally."""
    for char in "\\|*<":
        text = text.replace(char, "\\" + char)
    return text.replace("\n", " ")


def subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    found = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return found[0] if found else None


def commands(parser: argparse.ArgumentParser, path: str):
    """(command line, one-line help, parser) for every command that runs, depth first in the parser's order."""
    group = subcommands(parser)
    helps = {choice.dest: choice.help for choice in group._choices_actions} if group else {}
    for name, sub in (group.choices.items() if group else ()):
        line = f"{path} {name}"
        if subcommands(sub):
            yield from commands(sub, line)  # a command with subcommands is listed through them
        else:
            yield line, helps.get(name) or "", sub


def usage(line: str, parser: argparse.ArgumentParser) -> str:
    words = [line]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            continue
        words.append(metavar(action))
    if any(action.option_strings and not isinstance(action, argparse._HelpAction) for action in parser._actions):
        words.append("[options]")
    return " ".join(words)


def cli_markdown() -> str:
    """docs/cli.md's generated part: every command with its help and a table of its options (help text, default),
    built from the parser's actions, so it does not depend on the terminal's width."""
    from codespec.cli.options import build_parser

    with environment_free_defaults():
        parser = build_parser()
    listed = list(commands(parser, parser.prog))
    out = [
        f"*Generated from `codespec.cli.options.build_parser()`: do not edit above the marker; run `{REGENERATE}` to "
        "regenerate it. Hand-written notes follow the marker.*",
        "",
        "# Command line",
        "",
        parser.description or "",
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    for line, help_text, _ in listed:
        anchor = re.sub(r"[^\w\- ]", "", line.lower()).replace(" ", "-")
        out.append(f"| [`{line}`](#{anchor}) | {cell(help_text)} |")
    out += ["", "Every command also takes `-h`, `--help`: the same text as below, wrapped for the terminal.", ""]
    for line, help_text, sub in listed:
        out += [f"## `{line}`", ""]
        if help_text:
            out += [help_text[0].upper() + help_text[1:] + ("" if help_text.endswith(".") else "."), ""]
        if sub.description and sub.description != help_text:
            out += [sub.description, ""]
        out += [f"`{usage(line, sub)}`", ""]
        rows = [action for action in sub._actions if not isinstance(action, argparse._HelpAction)]
        if rows:
            out += ["| option | default | meaning |", "| --- | --- | --- |"]
            for action in rows:
                meaning = expand_help(action, sub.prog)
                if action.required and action.option_strings:
                    meaning = "required. " + meaning if meaning else "required"
                out.append(f"| {invocation(action)} | {default_cell(action)} | {cell(meaning)} |")
            out.append("")
    return "\n".join(out) + "\n"


def generated_part(text: str) -> str:
    if MARKER not in text:
        return text
    return text[: text.index(MARKER)]


def write_cli_doc() -> None:
    kept = ""
    if CLI_DOC.exists():
        text = CLI_DOC.read_text()
        if MARKER in text:
            kept = text[text.index(MARKER) + len(MARKER):]
    CLI_DOC.parent.mkdir(parents=True, exist_ok=True)
    CLI_DOC.write_text(cli_markdown() + MARKER + (kept if kept else "\n"))


def test_the_cli_doc_is_the_parsers():
    assert CLI_DOC.exists(), f"docs/cli.md is missing: run `{REGENERATE}`"
    text = CLI_DOC.read_text()
    assert MARKER in text, f"docs/cli.md has lost its marker line {MARKER!r}: run `{REGENERATE}`"
    assert generated_part(text) == cli_markdown(), (
        f"docs/cli.md's generated part differs from codespec.cli.options.build_parser(): run `{REGENERATE}`")


def test_the_generated_page_expands_defaults_and_percent_signs():
    page = cli_markdown()
    assert "%(" not in page and "%%" not in page
    assert "| `--port PORT` | `8012` |" in page
    assert "## `codespec ngram-cache build`" in page


# --- links ---------------------------------------------------------------------------------------------------------


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def without_code(text: str) -> str:
    """The text with fenced code blocks blanked (their lines kept, so line numbers hold)."""
    out, fence = [], None
    for line in text.split("\n"):
        stripped = line.lstrip()
        if fence is None and (stripped.startswith("```") or stripped.startswith("~~~")):
            fence = stripped[:3]
            out.append("")
        elif fence is not None:
            if stripped.startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but - and spaces dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in without_code(path.read_text()).split("\n"):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(without_code(path.read_text()).split("\n"), 1):
        line = re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", line)  # code spans: `[a](b)` there is text, not a link
        found += [(number, match.group(1)) for match in LINK.finditer(line)]
    return found


def test_every_relative_link_and_anchor_resolves():
    broken, headings = [], {}
    for path in markdown_files():
        for number, target in links(path):
            if re.match(r"^(https?:|mailto:)", target, re.IGNORECASE):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md":
                if linked not in headings:
                    headings[linked] = anchors(linked)
                if anchor not in headings[linked]:
                    broken.append(f"{where} (no heading #{anchor} in {linked.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_catches_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title: `--flag`\n\n## The GGUF's own blocks\n\n```\n# not a heading\n```\n")
    assert anchors(page) == {"a-title---flag", "the-ggufs-own-blocks"}
    page.write_text("[a](#x) `[b](#code)` [c](other.md#y) ![d](pic.png \"t\")\n```\n[e](#f)\n```\n")
    assert links(page) == [(1, "#x"), (1, "other.md#y"), (1, "pic.png")]


# --- the README ----------------------------------------------------------------------------------------------------


def test_the_readme_is_short_and_shows_the_commands_ci_runs():
    lines = README.read_text().split("\n")
    if lines[-1] == "":
        lines.pop()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the depth belongs in docs/"
    stripped = [line.strip() for line in lines]
    assert INSTALL in stripped, f"README.md must show the install command CI runs: {INSTALL}"
    assert TEST in stripped, f"README.md must show the test command CI runs: {TEST}"
    ci = (ROOT / ".ci" / "run").read_text().split("\n")
    assert INSTALL in ci and TEST in ci, ".ci/run and README.md disagree on the install or test command"


def test_the_readme_links_every_doc():
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in links(README)}
    missing = [str(path.relative_to(ROOT)) for path in sorted(DOCS.glob("*.md")) if path.resolve() not in linked]
    assert not missing, f"README.md's docs table does not link {missing}"


# --- the package ---------------------------------------------------------------------------------------------------


def package_files() -> list[str]:
    """The files git tracks under codespec/ (in a copy without git: every file there but caches)."""
    try:
        tracked = subprocess.run(["git", "ls-files", "codespec"], cwd=ROOT, capture_output=True, text=True, check=True)
        return [name for name in tracked.stdout.split("\n") if name]
    except (OSError, subprocess.CalledProcessError):
        return [str(path.relative_to(ROOT)) for path in (ROOT / "codespec").rglob("*")
                if path.is_file() and "__pycache__" not in path.parts]


def test_no_data_files_in_the_package():
    data = [name for name in package_files() if name.lower().endswith(DATA_SUFFIXES) and name not in RUNTIME_DATA]
    assert not data, f"data files under codespec/ (results belong in docs/benchmarks/): {data}"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    write_cli_doc()
    print(f"wrote {CLI_DOC.relative_to(ROOT)}'s generated part", file=sys.stderr)
