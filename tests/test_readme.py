"""Every shell command in README.md and CONTRIBUTING.md runs (or, where a test cannot run it, has the right form).

What counts as a command: the lines of each fenced block marked ```bash, ```sh, ```shell or
```console (in a console block, only the lines starting with ``$ ``). ``\\`` at a line's end
continues it, ``#`` starts a comment, ``&&`` chains commands, ``NAME=value`` before a command sets
its environment. Pipes, redirections and ``;`` are not supported (the test runs commands without a
shell): write one command per line. A block inside an HTML comment is not read (a section kept
for later).

What each command gets, by its program:

- run: ``python ...`` (a script, ``-m module`` or ``-c``) and ``torchrun ...`` (as ``python -m
  torch.distributed.run``) in a subprocess, with ``PYTHONPATH`` at the repository,
  ``OMP_NUM_THREADS=1`` and a timeout; ``pipecut ...`` and ``python -m pipecut ...`` in this
  process through ``pipecut.cli.main``, the console script's entry point (this checkout's, and no
  interpreter start: 2-3 s a command). Each block runs in a fresh temporary folder that links to
  the repository's top-level entries (so ``examples/demo.py`` resolves and a written ``plan.json``
  lands in the temporary folder), its commands in order.
  A block with ``torchrun`` is marked ``multiprocess`` and ``slow``: each launch costs 7-8 s of
  CPU a process (torch, transformers, tracing), so a directive launches 2 processes where the
  README says 4, or hands the block to a test that checks its output (``run-by``: the demo and
  the Training block, with its 4-process dp x pp launch, run in tests/test_examples.py). The
  whole file takes about 40 s of CPU: 26 s the Quickstart's torchrun block, 14 s the rest
  (``-m "not slow"``).
- form only, ``pip install ...``: no network in tests. Each requirement must parse, a pinned
  version must satisfy pyproject.toml's requirement for that package, ``-e PATH[extras]`` must name
  this repository and extras it declares.
- form only, ``python -m pytest``, ``ruff``, ``mypy``: each must be a step of ``.ci/run``, which CI
  runs (the test suite is not run again from inside itself).
- any other program fails this test: add it to ``RUN`` or ``CI_STEPS`` below.

Smaller sizes for the test, set in the README: an HTML comment right before a block, holding
directives separated by ``;`` or new lines::

    <!-- test: --steps 2 -->                                   appended to each command the block runs
    <!-- test: gpt2-175b --stages 64 => gpt2-tiny --stages 4 -->   text replaced in the block's commands
    <!-- test: skip: needs 8 GPUs -->                           the block's commands are checked for form only
    <!-- test: run-by: tests/test_examples.py::test_demo_runs -->   form only here: that test runs them

``run-by`` hands a block to a test that runs its commands once and checks their output (the
demo's falling loss, the training commands' equal losses): an expensive command runs once in
the suite, not here and again there. The test named must exist (checked below) and read its
commands from the README (``readme_block``), so neither side can drift.

A new README command therefore needs no edit here, at most a directive next to it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, ROOT / "CONTRIBUTING.md")  # the pages whose commands this file runs
SHELLS = ("bash", "sh", "shell", "console")
RUN = ("python", "python3", "pipecut", "torchrun")
CI_STEPS = ("pytest", "ruff", "mypy")
TIMEOUT_S = 300  # per command; a hang fails with the command's output so far
_OPERATORS = ("|", "||", ";", ">", ">>", "<", "&", "2>", "2>&1")


@dataclass(frozen=True)
class Command:
    """One command of the README: where it is, its words, and any ``NAME=value`` before them."""

    line: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    page: str = "README.md"

    def __str__(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env), *map(shlex.quote, self.argv)])


@dataclass(frozen=True)
class Block:
    """A fenced shell block: its first line, its commands, and the test directives before it."""

    line: int
    commands: tuple[Command, ...]
    append: tuple[str, ...] = ()
    replace: tuple[tuple[str, str], ...] = ()
    skip: str = ""
    run_by: str = ""
    page: str = "README.md"


def read_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The shell blocks of a Markdown text, outside HTML comments, with their directives.

    Example:
        >>> [b.commands[0].argv for b in read_blocks("<!-- test: --steps 2 -->\\n```bash\\npython a.py\\n```\\n")]
        [('python', 'a.py')]
    """
    comments = [m.span() for m in re.finditer(r"<!--.*?-->", text, re.DOTALL)]
    blocks = []
    for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", text, re.DOTALL | re.MULTILINE):
        if m.group(1) not in SHELLS or any(a <= m.start() < b for a, b in comments):
            continue
        first = text.count("\n", 0, m.start()) + 2  # the line after the fence
        before = re.search(r"<!--\s*test:((?:(?!-->).)*)-->\s*\Z", text[: m.start()], re.DOTALL)
        commands = _commands(m.group(2), first, console=m.group(1) == "console", page=page)
        blocks.append(_with_directives(Block(first, commands, page=page), before.group(1) if before else ""))
    return blocks


def _commands(body: str, first: int, *, console: bool, page: str = "README.md") -> tuple[Command, ...]:
    commands = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        start, text = first + i, lines[i]
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        i += 1
        if console:
            if not text.startswith("$ "):
                continue  # output
            text = text[2:]
        words = shlex.split(text, comments=True)
        if not words:
            continue
        bad = [w for w in words if w in _OPERATORS or w.startswith(("$(", "`"))]
        assert not bad, f"{page}:{start}: {text!r} uses {bad}: the README test runs one command per line, no shell"
        chain: list[list[str]] = [[]]
        for w in words:
            if w == "&&":
                chain.append([])
            else:
                chain[-1].append(w)
        for part in chain:
            env = []
            while part and re.fullmatch(r"[A-Za-z_]\w*=.*", part[0]):
                name, value = part.pop(0).split("=", 1)
                env.append((name, value))
            assert part, f"{page}:{start}: {text!r} has an empty command (around `&&`)"
            commands.append(Command(start, tuple(part), tuple(env), page))
    return tuple(commands)


def _with_directives(block: Block, directives: str) -> Block:
    append: list[str] = []
    replace: list[tuple[str, str]] = []
    skip = run_by = ""
    for d in (d.strip() for d in re.split(r"[;\n]", directives)):
        if d.startswith("skip:"):
            skip = d[len("skip:"):].strip() or "skipped"
        elif d.startswith("run-by:"):
            run_by = d[len("run-by:"):].strip()
        elif "=>" in d:
            old, new = (s.strip() for s in d.split("=>", 1))
            replace.append((old, new))
        elif d:
            append += shlex.split(d)
    return Block(block.line, block.commands, tuple(append), tuple(replace), skip, run_by, block.page)


def readme_block(test: str) -> Block:
    """The one README block whose ``run-by`` directive names ``test`` (``tests/FILE.py::NAME``)."""
    blocks = [b for b in read_blocks(README.read_text()) if b.run_by == test]
    assert len(blocks) == 1, f"README.md has {len(blocks)} blocks marked `<!-- test: run-by: {test} -->`, expected 1"
    return blocks[0]


def kind(cmd: Command) -> str:
    """``"run"``, ``"pip"`` (form only) or ``"ci"`` (a step of .ci/run); fails on any other program."""
    argv = cmd.argv
    prog = Path(argv[0]).name
    module = argv[2] if len(argv) > 2 and argv[1] == "-m" else ""
    if prog in ("pip", "pip3") or (prog.startswith("python") and module == "pip"):
        return "pip"
    if prog in CI_STEPS or (prog.startswith("python") and module == "pytest"):
        return "ci"
    if prog in RUN:
        return "run"
    pytest.fail(
        f"{cmd.page}:{cmd.line}: {cmd}: the README test does not know how to check {prog!r}. "
        f"Add it to RUN (run it) or CI_STEPS (a step of .ci/run) in tests/test_readme.py"
    )


def applied(block: Block) -> list[Command]:
    """The block's commands with its directives applied (replacements, then appended words)."""
    out = []
    for old, _ in block.replace:
        assert any(old in str(c) for c in block.commands), (
            f"{block.page}:{block.line}: the test directive replaces {old!r}, which no command of the block has"
        )
    for cmd in block.commands:
        text = " ".join(map(shlex.quote, cmd.argv))
        for old, new in block.replace:
            text = text.replace(old, new)
        argv = tuple(shlex.split(text))
        if kind(cmd) == "run":
            argv += block.append
        out.append(Command(cmd.line, argv, cmd.env, cmd.page))
    return out


# -- form checks --------------------------------------------------------------------------------


def _pyproject() -> dict[str, object]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def check_pip(cmd: Command) -> None:
    """``pip install`` of requirements that parse and agree with pyproject.toml, or of this checkout."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    where = f"{cmd.page}:{cmd.line}: {cmd}"
    argv = list(cmd.argv[cmd.argv.index("install") + 1:]) if "install" in cmd.argv else []
    assert argv, f"{where}: expected `pip install ...`"
    project = _pyproject()
    declared = {canonicalize_name(r.name): r for r in map(Requirement, project["dependencies"])}  # type: ignore[arg-type]
    extras = set(project["optional-dependencies"])  # type: ignore[arg-type]
    while argv:
        word = argv.pop(0)
        if word in ("-e", "--editable"):
            m = re.fullmatch(r"([^\[]+)(?:\[([\w,-]+)\])?", argv.pop(0))
            assert m and (ROOT / m.group(1)).resolve() == ROOT, f"{where}: -e should install this checkout (.)"
            unknown = set((m.group(2) or "").split(",")) - extras - {""}
            assert not unknown, f"{where}: pyproject.toml declares no extras {sorted(unknown)}, only {sorted(extras)}"
        elif word in ("-i", "--index-url", "--extra-index-url"):
            argv.pop(0)
        elif word.startswith("-"):
            assert word in ("-U", "--upgrade", "-q", "--quiet", "--pre", "--no-deps"), f"{where}: unknown option {word}"
        else:
            req = Requirement(word)
            ours = declared.get(canonicalize_name(req.name))
            pinned = [s.version for s in req.specifier if s.operator == "=="]
            if ours is not None and pinned:
                assert ours.specifier.contains(pinned[0], prereleases=True), (
                    f"{where}: {word} does not satisfy pyproject.toml's {ours}"
                )


def ci_steps() -> list[str]:
    """The commands .ci/run runs, each step of an ``&&`` chain on its own, comments dropped."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [" ".join(shlex.split(s)) for line in lines if not line.startswith("#")
            for s in line.split("#")[0].split("&&") if s.strip()]


def check_ci(cmd: Command) -> None:
    assert " ".join(cmd.argv) in ci_steps(), f"{cmd.page}:{cmd.line}: {cmd} is not a step of .ci/run: {ci_steps()}"


# -- running ------------------------------------------------------------------------------------


def _argv(cmd: Command) -> list[str]:
    prog, rest = Path(cmd.argv[0]).name, list(cmd.argv[1:])
    if prog == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *rest]
    return [sys.executable, *rest]  # python, python3


def _pipecut_args(cmd: Command) -> list[str] | None:
    """The arguments of a ``pipecut ...`` or ``python -m pipecut ...`` command, else None."""
    if Path(cmd.argv[0]).name == "pipecut":
        return list(cmd.argv[1:])
    if cmd.argv[0].startswith("python") and cmd.argv[1:3] == ("-m", "pipecut"):
        return list(cmd.argv[3:])
    return None


def run_block(block: Block, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Check each command's form or run it in ``cwd``, in order; fail with its output."""
    for entry in ROOT.iterdir():
        if entry.name != ".git" and not (cwd / entry.name).exists():
            (cwd / entry.name).symlink_to(entry)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    for cmd in applied(block):
        what = kind(cmd)
        if what == "pip":
            check_pip(cmd)
        elif what == "ci":
            check_ci(cmd)
        elif block.skip or block.run_by:
            continue
        elif (args := _pipecut_args(cmd)) is not None:
            _run_here(cmd, args, cwd, monkeypatch)
        else:
            _run(cmd, cwd, {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **dict(cmd.env)})


def _run(cmd: Command, cwd: Path, extra_env: dict[str, str]) -> None:
    where = f"{cmd.page}:{cmd.line}: {cmd}"
    env = {**os.environ, **extra_env}
    try:
        done = subprocess.run(_argv(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{where} ran past {TIMEOUT_S} s\n{e.stdout!s:.3000}\n{e.stderr!s:.3000}")
    assert done.returncode == 0, (
        f"{where} exited with {done.returncode}\n"
        f"stdout (end):\n{done.stdout[-3000:]}\nstderr (end):\n{done.stderr[-3000:]}"
    )


def _run_here(cmd: Command, args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``pipecut`` command through ``pipecut.cli.main``, the console script's own entry point, in
    this process: the same code without an interpreter start (2-3 s each, most of a small plan)."""
    import torch

    from pipecut.cli import main

    monkeypatch.chdir(cwd)
    for name, value in cmd.env:
        monkeypatch.setenv(name, value)
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    except SystemExit as e:  # argparse: --help, --version, a usage error
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    finally:
        torch.set_num_threads(threads)  # a command may set its own; the next test starts from ours
    assert code == 0, (
        f"{cmd.page}:{cmd.line}: {cmd} exited with {code}\n"
        f"stdout (end):\n{out.getvalue()[-3000:]}\nstderr (end):\n{err.getvalue()[-3000:]}"
    )


def _params() -> list[object]:
    params = []
    for b in (b for page in PAGES for b in read_blocks(page.read_text(), page.name)):
        launches = not b.run_by and any(Path(c.argv[0]).name == "torchrun" for c in b.commands)
        marks = [pytest.mark.multiprocess, pytest.mark.slow] if launches else []
        params.append(pytest.param(b, id=f"{b.page}:{b.line}", marks=marks))
    return params


@pytest.mark.parametrize("block", _params())
def test_readme_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_block(block, tmp_path, monkeypatch)


def test_run_by_names_a_test_that_reads_its_block() -> None:
    handed = [b for page in PAGES for b in read_blocks(page.read_text(), page.name) if b.run_by]
    for b in handed:
        path, _, name = b.run_by.partition("::")
        where = f"{b.page}:{b.line}: run-by: {b.run_by}"
        assert (ROOT / path).is_file() and name, f"{where}: expected an existing tests/FILE.py::test_name"
        source = (ROOT / path).read_text()
        # The test itself, and the block it runs taken from the README by this same name.
        assert re.search(rf"^def {re.escape(name)}\(", source, re.MULTILINE), f"{where}: {path} has no {name}"
        assert f'readme_block("{b.run_by}")' in source, f"{where}: {name} does not read its commands from the README"


def test_a_block_run_by_another_test_is_checked_for_form_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fails = Command(1, ("python", "-c", "raise SystemExit(1)"))
    run_block(Block(1, (fails,), run_by="tests/test_examples.py::test_demo_runs"), tmp_path, monkeypatch)
    with pytest.raises(AssertionError, match="exited with 1"):
        run_block(Block(1, (fails,)), tmp_path, monkeypatch)


def test_the_top_commands_install_and_run_the_demo_and_the_test_suite() -> None:
    # The README opens with two blocks: install + the demo (run above, as every block), install +
    # the test suite (its form only: the suite is not run from inside itself, CI runs it).
    demo, tests = read_blocks(README.read_text())[:2]
    assert [kind(c) for c in demo.commands] == ["pip", "pip", "run"]
    assert demo.commands[-1].argv == ("python", "examples/demo.py")
    assert [kind(c) for c in tests.commands] == ["pip", "pip", "ci"]
    assert tests.commands[-1].argv[:3] == ("python", "-m", "pytest")
    # CI runs every step of the test command, in order (with its lint and type checks in between).
    steps = iter(ci_steps())
    assert all(" ".join(c.argv) in steps for c in tests.commands), f"{ci_steps()} does not run {tests.commands}"


# -- the reader itself (pure) ---------------------------------------------------------------------

_SAMPLE = """\
# t

<!-- test: --steps 2; old text => new text -->
```bash
pip install torch==2.13.0 && python examples/demo.py --x 1   # a comment
python -m pipecut plan old text \\
    --stages 4
```

<!-- kept for later
```bash
pipecut train --model m
```
-->

```console
$ COLUMNS=80 pipecut plan old text
output line
```

<!-- test: skip: needs a GPU -->
```sh
torchrun --nproc-per-node 8 x.py
```

```python
print("not a shell block")
```

<!-- test: run-by: tests/test_examples.py::test_demo_runs -->
```bash
python examples/demo.py
```
"""


def test_reader_splits_chains_joins_lines_and_skips_comments() -> None:
    blocks = read_blocks(_SAMPLE)
    assert [b.line for b in blocks] == [5, 17, 23, 32]
    first = blocks[0]
    assert [c.argv for c in first.commands] == [
        ("pip", "install", "torch==2.13.0"), ("python", "examples/demo.py", "--x", "1"),
        ("python", "-m", "pipecut", "plan", "old", "text", "--stages", "4"),
    ]
    assert [c.line for c in first.commands] == [5, 5, 6]
    assert first.append == ("--steps", "2") and first.replace == (("old text", "new text"),)
    console = blocks[1].commands[0]
    assert console.argv == ("pipecut", "plan", "old", "text") and console.env == (("COLUMNS", "80"),)
    assert blocks[2].skip == "needs a GPU" and blocks[2].append == ()
    assert blocks[3].run_by == "tests/test_examples.py::test_demo_runs" and not blocks[3].skip
    elsewhere = read_blocks(_SAMPLE, "CONTRIBUTING.md")[0]  # messages name the page they come from
    assert elsewhere.page == "CONTRIBUTING.md" and {c.page for c in elsewhere.commands} == {"CONTRIBUTING.md"}


def test_directives_apply_to_the_commands_that_run() -> None:
    first = read_blocks(_SAMPLE)[0]
    run = [c.argv for c in applied(first) if kind(c) == "run"]
    assert run == [("python", "examples/demo.py", "--x", "1", "--steps", "2"),
                   ("python", "-m", "pipecut", "plan", "new", "text", "--stages", "4", "--steps", "2")]
    assert applied(first)[0].argv == ("pip", "install", "torch==2.13.0")  # pip gets no appended words
    stale = Block(1, (Command(1, ("python", "a.py")),), replace=(("nowhere", "x"),))
    with pytest.raises(AssertionError, match="replaces 'nowhere'"):
        applied(stale)


def test_form_checks_catch_wrong_pins_extras_and_steps() -> None:
    check_pip(Command(1, ("pip", "install", "torch==2.13.0")))
    check_pip(Command(1, ("pip", "install", "-e", ".[dev]")))
    with pytest.raises(AssertionError, match="does not satisfy"):
        check_pip(Command(1, ("pip", "install", "torch==2.0.0")))
    with pytest.raises(AssertionError, match="no extras"):
        check_pip(Command(1, ("pip", "install", "-e", ".[nope]")))
    check_ci(Command(1, ("ruff", "check", ".")))
    with pytest.raises(AssertionError, match=r"not a step of \.ci/run"):
        check_ci(Command(1, ("python", "-m", "pytest", "-x")))
    with pytest.raises(pytest.fail.Exception, match="does not know how to check 'make'"):
        kind(Command(1, ("make", "all")))
