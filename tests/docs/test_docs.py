"""What the tools say about themselves holds: the commands that README.md and docs/ show in code
are ones the tools take today (each tool's arguments parse, run.py's overrides compose: a sweep's
first value; nothing is run), the README's Python examples run, and every tool's --help gives each
default once."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex

import pytest
import torch
from helpers import ROOT, composed

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A command at the start of a line of code (a fenced or an indented block), after its
# continuation lines are joined; inline mentions in the prose are not commands.
COMMAND = re.compile(r"^\s*(?:\.venv/bin/)?python3? (run\.py|-m (?!venv\b|pip\b|pytest\b)[\w.]+)(.*)$", re.M)


def documented() -> list[tuple[str, str, list[str]]]:
    """(file, tool, arguments) of every command in the docs' code, each once."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in DOCS:
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for tool, rest in COMMAND.findall(text):
            words = shlex.split(re.split(r"\s#|\s>", rest)[0])  # no comment, no redirection
            found.setdefault((path.name, f"{tool} {shlex.join(words)}".strip()), [tool, *words])
    return [(name, line, argv) for (name, line), argv in found.items()]


COMMANDS = documented()


def test_the_docs_show_commands_of_every_kind() -> None:
    """The extraction finds the README's commands, so the test below has something to check."""
    readme = {argv[0] for name, _, argv in COMMANDS if name == "README.md"}
    assert {"run.py", "-m benchmarks.backward", "-m analysis.report", "-m datasets.irmas"} <= readme
    assert len(COMMANDS) > 40


class Parsed(Exception):  # noqa: N818  (not an error: the stop it asks for)
    """Raised in place of running a tool once its arguments have parsed."""


@pytest.mark.parametrize(("doc", "line", "argv"), COMMANDS, ids=[f"{d}: {c}" for d, c, _ in COMMANDS])
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
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        raise Parsed(parse(self, *a, **k))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    module = importlib.import_module(tool.removeprefix("-m "))
    with pytest.raises((Parsed, SystemExit)) as stop:
        module.main(args)
    if stop.type is SystemExit:
        refusal = capsys.readouterr().err.strip()
        cuda_here = torch.cuda.is_available()
        assert not cuda_here and "'cuda' asked for, but CUDA is not available here" in refusal, refusal


def test_the_readme_python_examples_run() -> None:
    """Each Python block of the README runs, in order, in one namespace (as a reader pastes them),
    except the sequence-parallel one, which needs torchrun, and the scan's, whose elements are the
    reader's; those two must still be valid Python."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    for block in blocks:
        compile(block, "README.md", "exec")
    runnable = [b for b in blocks if "init_process_group" not in b and "scan(elements" not in b]
    assert len(runnable) == len(blocks) - 2 >= 3
    namespace: dict = {}
    for block in runnable:
        exec(block, namespace)
    assert namespace["rnn"].weight_hh_l0.grad.shape == (20, 20)
    assert namespace["output"].shape == (16, 1000, 20)  # the Newton forward's GRU
    assert all(s.converged for s in namespace["gru"].solver_stats)
    x, y = next(iter(namespace["train"]))
    assert x.shape == (16, 1000, 1) and x.dtype == torch.float32 and y.shape == (16,)


TOOLS = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for folder in ("experiments", "analysis", "datasets")
    for path in (ROOT / folder).rglob("*.py")
    if '__name__ == "__main__"' in path.read_text()
)


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tools_help_gives_each_default_once(tool: str, capsys) -> None:
    """argparse's defaults formatter would add "(default: None)" to options resolved later, and a
    second default to a help that states its own."""
    with pytest.raises(SystemExit) as done:
        importlib.import_module(tool).main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith(f"usage: python -m {tool} ")
    assert "(default: None)" not in text
    assert not re.search(r"\(default[^)]*\) \(default", text), text


def test_every_tool_is_found() -> None:
    assert {
        "benchmarks.gpu_check",
        "benchmarks.backward",
        "analysis.strategies",
        "datasets.irmas",
    } <= set(TOOLS)
    assert len(TOOLS) >= 14
