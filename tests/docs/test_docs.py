"""What the documents say holds: the README opens with the two set-up commands a newcomer runs, the
commands that README.md and docs/ show in code, and the suite's docstrings and comments name (the
benchmark that re-measures a constant, say), are ones the tools take today (each tool's arguments
parse, run.py's overrides compose: a sweep's first value; nothing is run), the README's Python
examples run, and every tool's --help gives each default once. Nothing here counts prose: a document
may grow or shrink as long as what it shows still works."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex

import pytest
import torch
from helpers import ROOT, composed, extended_except

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A command at the start of a line of code (a fenced or an indented block), after its
# continuation lines are joined; inline mentions in the prose are not commands.
COMMAND = re.compile(r"^\s*(?:\.venv/bin/)?python3? (run\.py|-m (?!venv\b|pip\b|pytest\b)[\w.]+)(.*)$", re.M)
# What a newcomer types first: the README's first two code blocks, exactly (.ci/run runs the second).
INSTALL = "python3 -m venv .venv && .venv/bin/python -m pip install -r requirements.txt && "
SET_UP = (INSTALL + ".venv/bin/python run.py", INSTALL + ".venv/bin/python -m pytest -n auto")


def joined(path) -> str:
    """The document with its continuation lines joined, as a shell reads them."""
    return re.sub(r"\\\n\s*", " ", path.read_text())


# In the suite's code, also a command named inline, ``python -m tool args``, as comments name the
# benchmark that re-measures what they explain; a usage synopsis's [optional] brackets are dropped
# and its placeholders take a sample value; a tool named without arguments is asked for its --help.
INLINE = re.compile(r"``(?:\.venv/bin/)?python3? (run\.py|-m [\w.]*\w)( [^`]*)?``")
PLACEHOLDERS = {"M": "2", "N": "64", "DIR": "data"}
SUITE = ("bppsa_core", "benchmarks", "experiments", "analysis", "datasets", "toolbox")
SOURCES = [*sorted(path for folder in SUITE for path in (ROOT / folder).rglob("*.py")), ROOT / "run.py"]


def documented(paths, inline: bool = False) -> list[tuple[str, str, list[str]]]:
    """(file, tool, arguments) of every command in the files' code blocks (``inline``: and named
    inline), each once per file."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in paths:
        text = joined(path)
        for tool, rest in COMMAND.findall(text) + (INLINE.findall(text) if inline else []):
            rest = re.split(r"\s#|\s>", rest)[0]  # no comment, no redirection
            if inline:
                rest = rest.replace("[", "").replace("]", "")
            words = [PLACEHOLDERS.get(w, w) for w in shlex.split(rest)] if inline else shlex.split(rest)
            name = str(path.relative_to(ROOT))
            argv = [tool, *words] if words or not inline or tool == "run.py" else [tool, "--help"]
            found.setdefault((name, f"{tool} {shlex.join(words)}".strip()), argv)
    return [(name, line, argv) for (name, line), argv in found.items()]


COMMANDS = documented(DOCS)
NAMED = documented(SOURCES, inline=True)


def test_a_command_named_in_the_code_is_on_one_line() -> None:
    """Else ``NAMED`` misses it, or takes it without the words past the break (a comment's ``#``)."""
    broken = re.compile(r"``(?:\.venv/bin/)?python3?(?: [^`]*)?\n[^`]*``")
    split = [f"{p.relative_to(ROOT)}: {m[0]!r}" for p in SOURCES for m in broken.finditer(p.read_text())]
    assert not split, split


def test_the_readme_opens_with_the_two_set_up_commands() -> None:
    blocks = re.findall(r"```\w*\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert [b.strip() for b in blocks[:2]] == list(SET_UP)


def test_ci_runs_the_readme_test_command_then_the_extended_tests() -> None:
    """.ci/run runs the README's second set-up command step by step, then the tests it leaves out."""
    ran = [line.removeprefix("run ").strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ran = [line for line in ran if line.startswith(("python3 ", ".venv/bin/"))]
    steps = SET_UP[1].split(" && ")
    assert ran[: len(steps)] == steps, ran
    assert ".venv/bin/python -m pytest -n auto -m extended" in ran[len(steps) :], ran


def fenced_commands(path) -> list[str]:
    """The lines of a document's fenced blocks that run a suite tool (not venv, pip, pytest or -c)."""
    lines = []
    for block in re.findall(r"```\w*\n(.*?)```", joined(path), re.S):
        for line in block.splitlines():
            if re.match(r"\s*(\.venv/bin/)?python3? (run\.py|-m )", line) and not re.search(
                r"python3? -m (venv|pip|pytest)\b", line
            ):
                lines.append(line)
    return lines


SHOWING = [doc for doc in DOCS if fenced_commands(doc)]


@pytest.mark.parametrize("doc", SHOWING, ids=[d.name for d in SHOWING])
def test_the_extraction_finds_every_command_a_doc_shows(doc) -> None:
    """Each tool command of a fenced block is among those the test below parses, so a command the
    extraction missed cannot go unchecked."""
    taken = {line for name, line, _ in COMMANDS if name == str(doc.relative_to(ROOT))}
    assert taken
    for line in fenced_commands(doc):
        tool, rest = COMMAND.match(line).groups()
        words = shlex.split(re.split(r"\s#|\s>", rest)[0])
        assert f"{tool} {shlex.join(words)}".strip() in taken, line


def test_the_readme_shows_how_to_run_the_suite() -> None:
    """The README's commands include the main job's and a benchmark's: the front door shows how to
    run both (what else it shows may change)."""
    tools = {argv[0] for name, _, argv in COMMANDS if name == "README.md"}
    assert "run.py" in tools
    assert any(tool.startswith("-m benchmarks.") for tool in tools), tools


# The refusals a GPU command gets on a machine without one: the only ones a documented command may get.
NO_GPU = ("'cuda' asked for, but CUDA is not available here", "error: no CUDA device here; accepted:")


class Parsed(Exception):  # noqa: N818  (not an error: the stop it asks for)
    """Raised in place of running a tool once its arguments have parsed."""


# The README's commands in the default run; those of docs/ and the code under extended.
@pytest.mark.parametrize(
    ("doc", "line", "argv"),
    extended_except(COMMANDS + NAMED, *(c for c in COMMANDS if c[0] == "README.md")),
    ids=[f"{d}: {c}" for d, c, _ in COMMANDS + NAMED],
)
def test_a_documented_command_is_taken(doc: str, line: str, argv: list[str], monkeypatch, capsys) -> None:
    tool, args = argv[0], argv[1:]
    if tool == "run.py":
        from hydra.core.override_parser.overrides_parser import OverridesParser

        overrides = OverridesParser.create().parse_overrides([a for a in args if a != "-m"])
        first = [
            f"{o.get_key_element()}={next(iter(o.sweep_iterator())) if o.is_sweep_override() else o.value()}"
            for o in overrides
        ]
        composed(*first, hydra=any(o.key_or_group.startswith("hydra") for o in overrides))
        return
    module = importlib.import_module(tool.removeprefix("-m "))
    # stopped after the tool's own parse_args, where it has one (its checks beyond argparse's
    # included), else after argparse's
    owner = module if hasattr(module, "parse_args") else argparse.ArgumentParser
    parse = owner.parse_args

    def parse_then_stop(*a, **k):
        raise Parsed(parse(*a, **k))

    monkeypatch.setattr(owner, "parse_args", parse_then_stop)
    with pytest.raises((Parsed, SystemExit)) as stop:
        module.main(args)
    if args == ["--help"]:  # a tool named, not a command: it is there and answers
        assert stop.type is SystemExit and stop.value.code == 0
    elif stop.type is SystemExit:
        refusal = capsys.readouterr().err.strip()
        cuda_here = torch.cuda.is_available()
        assert not cuda_here and any(no_gpu in refusal for no_gpu in NO_GPU), refusal


def test_the_readme_python_examples_run() -> None:
    """Each Python block of the README runs, in order, in one namespace (as a reader pastes them),
    except the sequence-parallel one, which needs torchrun, the captured step's, which needs CUDA
    (tests/core/test_capture.py runs it with the ``gpu`` marker), and the scan's, whose elements are
    the reader's; those must still be valid Python. What the examples make is what they promise."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    for block in blocks:
        compile(block, "README.md", "exec")
    namespace: dict = {}
    modules = torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM
    not_here = ("init_process_group", "torch.cuda.graph", "scan(elements")
    try:
        for block in blocks:
            if not any(needs in block for needs in not_here):
                exec(block, namespace)
        swapped = torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM  # the swap into a torch.nn program
    finally:
        torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM = modules  # the other tests' torch.nn
    assert [m.__module__ for m in swapped] == ["bppsa_core.nn"] * 3
    assert namespace["rnn"].weight_hh_l0.grad.shape == (20, 20)
    assert namespace["output"].shape == (16, 1000, 20)  # the Newton forward's GRU
    assert all(s.converged for s in namespace["gru"].solver_stats)
    x, y = next(iter(namespace["train"]))
    assert x.shape == (16, 1000, 1) and x.dtype == torch.float32 and y.shape == (16,)


def tool_name(path) -> str:
    """The name `python -m` runs a tool file by: a package's __main__.py runs as the package."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__main__")


TOOLS = sorted(
    tool_name(path)
    for folder in ("experiments", "analysis", "datasets", "benchmarks")
    for path in (ROOT / folder).rglob("*.py")
    if '__name__ == "__main__"' in path.read_text()
)


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tools_help_gives_each_default_once(tool: str, capsys) -> None:
    """argparse's defaults formatter would add "(default: None)" to options resolved later, and a
    second default to a help that states its own. The usage names the tool, or for an alias
    (a tool whose main is another tool's) the tool it stands for."""
    main = importlib.import_module(tool).main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    names = {tool} | ({main.__module__} & set(TOOLS))
    assert any(text.startswith(f"usage: python -m {name} ") for name in names), text[:80]
    assert "(default: None)" not in text
    assert not re.search(r"\(default[^)]*\) \(default", text), text


def test_the_tools_the_docs_name_are_found() -> None:
    """The help test above covers the tools the README and docs/BENCHMARKS.md send users to."""
    assert {
        "benchmarks.gpu_check",
        "experiments.gpu_check",
        "benchmarks.backward",
        "benchmarks.distributed",
        "analysis.schemes",
        "analysis.report",
        "datasets.irmas",
    } <= set(TOOLS)
