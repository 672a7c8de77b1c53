"""The documentation holds together: its Python runs, its pages stay short, its links land.

**Python blocks.** Every fenced ```python block of README.md, CONTRIBUTING.md and docs/ (outside
HTML comments) runs. A page's blocks run top to bottom in one namespace, in a fresh temporary
folder, as a reader pasting them into one session would: a block may use what an earlier block of
its page made (docs/schedules.md's trace example reads the trainer and the simulation made above
it). An HTML comment right before a block holds directives, separated by ``;``, in the form
tests/test_readme.py gives shell blocks::

    <!-- test: with: mlp -->                           names the block uses but does not make (SETUPS)
    <!-- test: num_stages=8 => num_stages=2 -->          text replaced before it runs (smaller sizes)
    <!-- test: skip: needs torchrun: 2 replicas -->      not run, and the reason why

``with`` runs a setup of SETUPS below into the page's namespace before the block: a small model,
its example inputs and targets, a plan of it, a loss and an optimizer factory under the names the
docs use (``model``, ``x``, ``y``, ``plan``, ``loss_fn``, ``optimizer``...). A block that fails
names its page and line. ``skip`` needs a reason; a replacement must match. Pages in UNMARKED are
left out whole, each with its reason, and the test fails once one is no longer needed.

**Length.** Every page of docs/ stays under PAGE_LINES lines, README.md under README_LINES (pages in
LONG_PAGES excepted, for as long as they are long).

**Links.** Every relative link of README.md, CONTRIBUTING.md and docs/ reaches a file, and where it
names a heading (``page.md#anchor``, ``#anchor``), a heading of that page by GitHub's anchor rule.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE_LINES = 600
README_LINES = 220
# Pages kept out of the checks, with why; each must still need it (tested), so none outlives its reason.
LONG_PAGES: dict[str, str] = {}
UNMARKED: dict[str, str] = {}


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


# -- reading blocks ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PyBlock:
    """A fenced Python block: where it is, its code with the directives applied, and the directives."""

    page: str
    line: int
    code: str
    setups: tuple[str, ...] = ()
    skip: str = ""


def read_python_blocks(text: str, page: str = "README.md") -> list[PyBlock]:
    """The Python blocks of a Markdown text, outside HTML comments, with their directives applied.

    Example:
        >>> [b.code for b in read_python_blocks("<!-- test: 8 => 2 -->\\n```python\\nx = 8\\n```\\n")]
        ['x = 2\\n']
    """
    comments = [m.span() for m in re.finditer(r"<!--.*?-->", text, re.DOTALL)]
    blocks = []
    for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", text, re.DOTALL | re.MULTILINE):
        if m.group(1) != "python" or any(a <= m.start() < b for a, b in comments):
            continue
        line = text.count("\n", 0, m.start()) + 2  # the block's first line of code
        before = re.search(r"<!--\s*test:((?:(?!-->).)*)-->\s*\Z", text[: m.start()], re.DOTALL)
        code, setups, skip = m.group(2), [], ""
        for d in (d.strip() for d in (before.group(1) if before else "").split(";")):
            if d.startswith("skip:"):
                skip = d[len("skip:"):].strip()
                assert skip, f"{page}:{line}: `skip:` needs a reason"
            elif d.startswith("with:"):
                setups += [s.strip() for s in d[len("with:"):].split(",") if s.strip()]
            elif "=>" in d:
                old, new = (s.strip() for s in d.split("=>", 1))
                assert old in code, f"{page}:{line}: the test directive replaces {old!r}, which the block does not hold"
                code = code.replace(old, new)
            elif d:
                pytest.fail(f"{page}:{line}: unknown test directive {d!r} (with:, skip: or OLD => NEW)")
        blocks.append(PyBlock(page, line, code, tuple(setups), skip))
    return blocks


# -- what the blocks use and do not make -----------------------------------------------------------


def _common(ns: dict[str, Any]) -> None:
    import torch
    import torch.nn.functional as F
    from torch.optim.lr_scheduler import LambdaLR

    import runtime
    from partitioner import Capture, Cluster, Costing, Cut, LayoutSpace, partition
    from runtime.precision import MixedPrecision

    ns.update(torch=torch, F=F, LambdaLR=LambdaLR, Cluster=Cluster, partition=partition,
              Cut=Cut, Capture=Capture, Costing=Costing, LayoutSpace=LayoutSpace,
              warmup=lambda step: min(1.0, (step + 1) / 10),
              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
              make_opt=lambda ps: torch.optim.SGD(ps, lr=0.05), MixedPrecision=MixedPrecision)
    for name in ("PipelineTrainer", "Execution", "Init", "DataParallel", "Weights"):
        ns[name] = getattr(runtime, name)


def _mlp(ns: dict[str, Any], cwd: Path) -> None:
    """An MLP of eight layers classifying 16 rows into 8 classes, and a 2-stage plan of it."""
    import torch

    from partitioner.zoo import MLPChain

    _common(ns)
    model = MLPChain((16, 32, 32, 32, 32, 32, 32, 32, 8))
    x, y = torch.randn(16, 16), torch.randint(0, 8, (16,))
    ns.update(model=model, x=x, y=y, inputs=x, targets=y, loss_fn=torch.nn.functional.cross_entropy,
              plan=ns["partition"](model, (x[:2],), 2, cut=ns["Cut"](microbatches=8)))


def _llama(ns: dict[str, Any], cwd: Path) -> None:
    """A 2-layer Llama: its config and class, a saved copy at ``llama-70b/``, and a 2-stage plan of it on meta."""
    import torch
    from transformers import LlamaForCausalLM

    from runtime import empty_weights

    _common(ns)
    tiny = _example("tiny_hf_folder")
    tiny.write_folder(cwd / "llama-70b", layers=2)
    config = LlamaForCausalLM.from_pretrained(cwd / "llama-70b").config
    with empty_weights():
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (4, 16))
    ns.update(LlamaForCausalLM=LlamaForCausalLM, config=config, model=model, ids=ids, x=ids, y=ids,
              mask=torch.ones_like(ids), start=0, steps=2,
              plan=ns["partition"](model, (ids[:2],), 2, cut=ns["Cut"](microbatches=2)))


def _run_toml(ns: dict[str, Any], cwd: Path) -> None:
    """``run.toml``: two pipeline stages of a 2-layer Llama folder on a token file, as docs/train.md runs them."""
    tiny = _example("tiny_hf_folder")
    tiny.write_folder(cwd / "tiny-llama", layers=2)
    tiny.write_tokens(cwd / "tokens.npy", tokens=20_000)
    (cwd / "run.toml").write_text('model = "tiny-llama"\ndata = "tokens.npy"\nout = "run"\npp = 2\n'
                                  'seq_len = 32\nglobal_batch = 4\ncheckpoint_every = 2\n')


SETUPS: dict[str, Callable[[dict[str, Any], Path], None]] = {"mlp": _mlp, "llama": _llama, "run_toml": _run_toml}


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- running them ----------------------------------------------------------------------------------


def run_page(blocks: list[PyBlock], cwd: Path) -> None:
    """Run the blocks in order in one namespace; a failure names the block's page and line."""
    ns: dict[str, Any] = {"__name__": "__docs__"}
    for b in blocks:
        if b.skip:
            continue
        for name in b.setups:
            assert name in SETUPS, f"{b.page}:{b.line}: no setup {name!r}; there are {sorted(SETUPS)}"
            SETUPS[name](ns, cwd)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(b.code, f"{b.page}:{b.line}", "exec"), ns)  # our own page's example
        except Exception as e:
            raise AssertionError(f"{b.page}:{b.line}: the block raised {type(e).__name__}: {e}") from e


def _with_blocks() -> list[Any]:
    params = []
    for page in pages():
        name = _name(page)
        blocks = read_python_blocks(page.read_text(), name)
        if blocks and name not in UNMARKED:
            slow = any("llama" in b.setups or "run_toml" in b.setups for b in blocks)
            params.append(pytest.param(name, id=name, marks=[pytest.mark.slow] if slow else []))
    return params


@pytest.mark.parametrize("page", _with_blocks())
def test_python_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_page(read_python_blocks((ROOT / page).read_text(), page), tmp_path)


def test_every_skip_says_why_and_the_exemptions_are_still_needed() -> None:
    for page in pages():
        for b in read_python_blocks(page.read_text(), _name(page)):
            assert not b.skip or len(b.skip) > 10, f"{b.page}:{b.line}: say why the block cannot run here"
    for name in UNMARKED:
        assert read_python_blocks((ROOT / name).read_text(), name), f"{name} has no Python block: drop it from UNMARKED"
    for name in LONG_PAGES:
        assert len((ROOT / name).read_text().splitlines()) > PAGE_LINES, f"{name} is short now: drop it from LONG_PAGES"


def test_a_failing_block_names_its_page_and_line(tmp_path: Path) -> None:
    text = ("text\n\n```python\nx = 1\n```\n\n<!-- test: skip: needs 8 GPUs to run -->\n"
            "```python\nraise SystemExit\n```\n\n<!-- test: with: nothing -->\n```python\nx\n```\n\n"
            "```python\ny = x + undefined\n```\n")
    blocks = read_python_blocks(text, "docs/a.md")
    assert [(b.line, b.skip, b.setups) for b in blocks] == [
        (4, "", ()), (9, "needs 8 GPUs to run", ()), (14, "", ("nothing",)), (18, "", ())]
    with pytest.raises(AssertionError, match=r"docs/a\.md:14: no setup 'nothing'"):
        run_page(blocks, tmp_path)
    with pytest.raises(AssertionError, match=r"docs/a\.md:18: the block raised NameError"):
        run_page([blocks[0], blocks[1], blocks[3]], tmp_path)
    with pytest.raises(AssertionError, match="replaces 'z = 3'"):
        read_python_blocks("<!-- test: z = 3 => z = 4 -->\n```python\nx = 1\n```\n")


# -- length ------------------------------------------------------------------------------------


def test_pages_stay_short() -> None:
    long = {}
    for page in pages():
        name, lines = _name(page), len(page.read_text().splitlines())
        bound = README_LINES if name == "README.md" else PAGE_LINES
        if lines > bound and name not in LONG_PAGES:
            long[name] = lines
    assert not long, f"pages over {PAGE_LINES} lines (README.md: {README_LINES}): {long}; split them by reader"


# -- links -------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text, lower case, punctuation dropped, spaces to hyphens.

    Example:
        >>> slug('Sharded over the replicas: FSDP2 (`engine="fsdp"`)')
        'sharded-over-the-replicas-fsdp2-enginefsdp'
        >>> slug("Data \N{MULTIPLICATION SIGN} pipeline parallelism")
        'data--pipeline-parallelism'
    """
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _prose(text: str) -> str:
    """The text without fenced blocks and inline code, which hold no links."""
    text = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets ``-1``, ``-2``... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    prose = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.DOTALL | re.MULTILINE)  # a # in code is no heading
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", prose, re.MULTILINE):
        s = slug(m.group(1))
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(page: Path) -> list[str]:
    """Each relative link of the page that reaches no file, or no heading of the file it names."""
    broken = []
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", _prose(page.read_text())):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: {dest.name} has no heading #{anchor}")
    return broken


def test_every_link_reaches_a_file_and_a_heading() -> None:
    broken = {_name(page): b for page in pages() if (b := broken_links(page))}
    assert not broken, broken


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# B\n\n## Mixed precision\n\n## Mixed precision\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#mixed-precision) [twice](b.md#mixed-precision-1) [top](#a) "
                    "[gone](c.md) [no heading](b.md#fp8) `[code](x.md)` [web](https://example.org)\n\n# A\n")
    assert broken_links(page) == ["c.md: no such file", "b.md#fp8: b.md has no heading #fp8"]
