"""The documentation: the site builds strict, and the commands in README.md and docs/*.md match the code.

Every fenced shell block (bash, sh, shell, console) is read, and every code span in the text that starts like
a command of ours (`python ...`, `ldm-...`, `make ...`, `pytest ...`); each command of ours in it (`python main.py`,
`python scripts/X.py`, `python benchmarks/X.py`, `python -m pkg.mod`, `ldm-*`, `make TARGET`, `pytest PATH`,
`torchrun ... main.py`, `srun python main.py`) must name a script or module that exists, repository files that
exist, and only flags its argument parser has. Untagged blocks are program output or file trees, not commands.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHELL_TAGS = {"bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|"}
# Relative paths under these folders are repository files; a command that names one must find it there.
REPO_FOLDERS = ("configs/", "scripts/", "benchmarks/", "tests/", "examples/", "ldm/", "docs/")
OUR_PACKAGES = {"ldm", "examples", "benchmarks", "scripts", "tests"}
FLAG = re.compile(r"^--?[A-Za-z][\w-]*$")


@dataclass(frozen=True)
class Command:
    """One command of a fenced shell block: its words and where it was written (file:line)."""

    where: str
    words: tuple[str, ...]


def shell_commands(text: str, source: str) -> list[Command]:
    """The commands in the fenced shell blocks of a markdown text: continuations joined, comments dropped."""
    commands: list[Command] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w-]*)", lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, tag = len(opening.group(1)), opening.group(2), opening.group(3).lower()
        body: list[tuple[int, str]] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i + 1, lines[i][indent:]))
            i += 1
        i += 1
        if tag in SHELL_TAGS:
            commands += _block_commands(body, source, console=tag == "console")
    return commands


INLINE = re.compile(r"(?<!`)`((?:[A-Z_]+=\S+ )*(?:python3? |ldm-[\w-]+|make |pytest|torchrun )[^`]*)`(?!`)")


def inline_commands(text: str, source: str) -> list[Command]:
    """The commands written as code spans in running text (`python scripts/X.py --flag`), outside fenced blocks.

    A span may wrap onto the next line of its paragraph; its place is the paragraph's first line.
    """
    commands: list[Command] = []
    fenced, paragraph, start = False, [], 0
    for number, line in enumerate([*text.split("\n"), ""], 1):
        if re.match(r"^\s*(`{3,}|~{3,})", line):
            fenced = not fenced
        if fenced or not line.strip() or line.lstrip().startswith("```"):
            for span in INLINE.findall(" ".join(paragraph)):
                commands += _block_commands([(start, span)], source, console=False)
            paragraph = []
            continue
        if not paragraph:
            start = number
        paragraph.append(line.strip())
    return commands


def _block_commands(body: list[tuple[int, str]], source: str, console: bool) -> list[Command]:
    """The commands of one shell block, each line number the one its command starts on."""
    commands: list[Command] = []
    joined, start = "", 0
    for number, line in body:
        if console and not joined:
            if not line.startswith("$ "):
                continue  # program output
            line = line[2:]
        if not joined:
            start = number
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        joined += line
        try:
            words = shlex.split(joined, comments=True)
        except ValueError as err:
            raise ValueError(f"{source}:{start}: cannot split the command {joined!r}: {err}") from err
        joined = ""
        command: list[str] = []
        for word in [*words, ";"]:
            if word in SEPARATORS or word.endswith(";"):
                if word.endswith(";") and word != ";":
                    command.append(word[:-1])
                if command:
                    commands.append(Command(f"{source}:{start}", tuple(command)))
                command = []
            else:
                command.append(word)
    return commands


def console_scripts() -> dict[str, str]:
    """setup.py's console scripts: command name -> module whose `main` it runs."""
    text = (REPO / "setup.py").read_text()
    return dict(re.findall(r"[\"'](ldm-[\w-]+)\s*=\s*([\w.]+):main[\"']", text))


def make_targets() -> set[str]:
    """The targets the Makefile defines."""
    text = (REPO / "Makefile").read_text()
    return {name for names in re.findall(r"^([\w.$()/ -]+?)\s*:(?!=)", text, re.M) for name in names.split()}


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser a program built."""

    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


@contextlib.contextmanager
def _stop_at_parsing():
    """Make every ArgumentParser raise _Parsed with itself instead of parsing arguments."""
    saved = argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_known_intermixed_args

    def stop(self, args=None, namespace=None):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = stop
    argparse.ArgumentParser.parse_known_intermixed_args = stop
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_known_intermixed_args = saved


_FLAGS: dict[tuple[str, str], frozenset[str]] = {}


def program_flags(kind: str, target: str) -> frozenset[str]:
    """The option strings of a program of ours, read once: kind is "path" (a .py file), "module" or "script".

    The program runs in this process until it builds its parser and parses; where that cannot work, its
    `--help` output in a child process gives the flags.
    """
    key = (kind, target)
    if key not in _FLAGS:
        _FLAGS[key] = _flags_in_process(kind, target) or _flags_from_help(kind, target)
    return _FLAGS[key]


def _flags_in_process(kind: str, target: str) -> frozenset[str] | None:
    argv, path = list(sys.argv), list(sys.path)
    sys.argv = [target, "--help"]
    try:
        with _stop_at_parsing(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if kind == "path":
                runpy.run_path(str(REPO / target), run_name="__main__")
            elif kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=False)
            else:
                importlib.import_module(target).main()
    except _Parsed as parsed:
        return frozenset(parsed.parser._option_string_actions)
    except (Exception, SystemExit):
        return None
    finally:
        sys.argv, sys.path[:] = argv, path
    return None


def _flags_from_help(kind: str, target: str) -> frozenset[str]:
    command = {"path": [str(REPO / target)], "module": ["-m", target], "script": ["-c", _script_call(target)]}[kind]
    done = subprocess.run(
        [sys.executable, *command, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", done.stdout))


def _script_call(module: str) -> str:
    return f"import sys; from {module} import main; sys.exit(main())"


def check_commands(commands: list[Command]) -> list[str]:
    """What is wrong in these commands, one line each naming where: a missing script, file, target or flag."""
    problems: list[str] = []
    scripts = console_scripts()
    targets: set[str] | None = None
    for command in commands:
        words = list(command.words)
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value before the program
            words.pop(0)
        if words and words[0] == "srun":  # srun [its options] PROGRAM ...
            words = words[1:]
            while words and words[0].startswith("-"):
                words.pop(0)
        if not words:
            continue
        program, args = words[0], words[1:]
        where = f"{command.where}: `{' '.join(command.words)[:80]}`"
        if program == "make":
            targets = targets if targets is not None else make_targets()
            for target in args:
                if not target.startswith("-") and "=" not in target and target not in targets:
                    problems.append(f"{where}: the Makefile has no target {target!r}")
            continue
        if program == "pytest" or (_is_python(program) and args[:2] == ["-m", "pytest"]):
            for arg in args[2:] if program != "pytest" else args:
                path = arg.split("::")[0]
                if not path.startswith("-") and ("/" in path or path.endswith(".py")) and not (REPO / path).exists():
                    problems.append(f"{where}: no such test file or folder: {path}")
            continue
        found = _program_of(program, args, scripts)
        if found is None:
            continue  # not ours: pip, git, mkdocs, cd, ...
        kind, target, args, label = found
        missing = _missing_program(kind, target)
        if missing:
            problems.append(f"{where}: {missing}")
            continue
        problems += [f"{where}: {p}" for p in _check_arguments(kind, target, args, label)]
    return problems


def _is_python(word: str) -> bool:
    return re.fullmatch(r"(.*/)?python(3(\.\d+)?)?", word) is not None


def _program_of(program: str, args: list[str], scripts: dict[str, str]) -> tuple[str, str, list[str], str] | None:
    """(kind, target, its arguments, how the docs name it) for a program of ours; None for anyone else's."""
    if program in scripts:
        return "script", scripts[program], args, program
    if program.startswith("ldm-"):
        return "script", "", args, program  # an ldm command setup.py does not define
    if program == "torchrun":
        at = next((i for i, a in enumerate(args) if a.endswith(".py")), None)
        return None if at is None else ("path", args[at], args[at + 1 :], args[at])
    if not _is_python(program):
        return None
    while args and args[0].startswith("-") and args[0] != "-m":
        args = args[1:]  # python's own flags
    if args[:1] == ["-m"] and len(args) > 1:
        module = args[1]
        return ("module", module, args[2:], f"-m {module}") if module.split(".")[0] in OUR_PACKAGES else None
    if args and args[0].endswith(".py"):
        return "path", args[0], args[1:], args[0]
    return None


def _missing_program(kind: str, target: str) -> str | None:
    if kind == "script" and not target:
        return "setup.py defines no such ldm command"
    if kind == "path" and not (REPO / target).is_file():
        return f"no such script: {target}"
    if kind == "module":
        base = REPO / target.replace(".", "/")
        if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
            return f"no such module: {target} (no {base.relative_to(REPO)}.py or {base.relative_to(REPO)}/__main__.py)"
    return None


def _check_arguments(kind: str, target: str, args: list[str], label: str) -> list[str]:
    problems: list[str] = []
    flags: frozenset[str] | None = None
    for arg in args:
        word = arg.strip("[]")  # [--ema]: an optional flag
        if word == "--":
            break
        if word.startswith("-") and FLAG.match(word.split("=")[0]):
            flags = flags if flags is not None else program_flags(kind, target)
            if word.split("=")[0] not in flags:
                problems.append(f"{label} has no flag {word.split('=')[0]} (its --help: {' '.join(sorted(flags))})")
            word = word.partition("=")[2]
        elif "=" in word:
            word = word.partition("=")[2]  # key.path=value: the value may be a repository path
        if word.startswith(REPO_FOLDERS) and not any(c in word for c in "<>{}"):
            if "*" in word:
                if not glob.glob(str(REPO / word)):
                    problems.append(f"no repository file matches {word}")
            elif not (REPO / word).exists():
                problems.append(f"no such file or folder in the repository: {word}")
    return problems


def doc_files() -> list[Path]:
    """README.md and every page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material", reason="mkdocs-material (the site's theme) is not installed")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr}"


def test_doc_commands_match_the_code():
    commands = []
    for path in doc_files():
        text, source = path.read_text(), str(path.relative_to(REPO))
        commands += shell_commands(text, source) + inline_commands(text, source)
    assert len(commands) > 20, f"only {len(commands)} commands found in the docs: is the parser broken?"
    problems = check_commands(commands)
    assert not problems, "commands in the docs that do not match the code:\n" + "\n".join(problems)


def test_readme_commands_come_first():
    """CI runs the README's second command: the first two stay `make quickstart` and `make test`."""
    commands = shell_commands((REPO / "README.md").read_text(), "README.md")
    assert [c.words for c in commands[:2]] == [("make", "quickstart"), ("make", "test")]


def test_the_checker_reports_drift():
    snippet = """
Some text.

```bash
python scripts/no_such.py --x 1
python main.py -t -b configs/finetune/no-such-preset.yaml data.params.root=/path/to/images
python scripts/convert.py --src a.safetensors --dst b --no-such-flag \\
    --half     # a comment, and a continued line
ldm-no-such-command --help
python -m examples.no_such_module
make no-such-target && pytest tests/test_no_such.py
torchrun --nproc-per-node 2 main.py -t -b configs/finetune/sd-folder.yaml --bogus
```

```yaml
model: {target: not.checked}
```

In the text, `python benchmarks/gpu_8gb.py --family sdxl --no-such-option` is checked too.
"""
    problems = check_commands(shell_commands(snippet, "snippet.md") + inline_commands(snippet, "snippet.md"))
    expected = [
        "snippet.md:5: `python scripts/no_such.py --x 1`: no such script: scripts/no_such.py",
        "no such file or folder in the repository: configs/finetune/no-such-preset.yaml",
        "scripts/convert.py has no flag --no-such-flag",
        "setup.py defines no such ldm command",
        "no such module: examples.no_such_module",
        "the Makefile has no target 'no-such-target'",
        "no such test file or folder: tests/test_no_such.py",
        "main.py has no flag --bogus",
        "snippet.md:19: `python benchmarks/gpu_8gb.py --family sdxl --no-such-option`: benchmarks/gpu_8gb.py has no",
    ]
    for text in expected:
        assert any(text in p for p in problems), f"not reported: {text}\nreported:\n" + "\n".join(problems)
    assert len(problems) == len(expected), "\n".join(problems)
