"""The documentation is part of the build: the docs build with no warnings, every example in README.md and docs/
runs, and every ``powertrain ...`` command line shown parses with the current flags (issue 37).

Python blocks (```` ```python ````) run as standalone scripts in a temporary directory. The line before a block may
say how: ``<!-- example: torchrun 2 -->`` runs it under ``torchrun --nproc-per-node 2`` (gloo on CPU);
``<!-- example: skip (why) -->`` does not run it (a GPU, a cluster, a fragment), and must say why.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Collection
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from types import ModuleType

import pytest

from cli_utils import run_cli, torchrun
from powertrain.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 12_288  # bytes: a front page, not the manual (issue 37)

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
_MARK = re.compile(r"<!--\s*example:\s*(torchrun (\d+)|skip \((.+?)\))\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    mark: str  # "" (run), "torchrun N", or "skip"

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(text: str, page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown ``text``, each with the example marker on the line before it."""
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        kind = "" if mark is None else ("skip" if mark.group(3) else f"torchrun {mark.group(2)}")
        out.append(Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2), kind))
    return out


def _all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page.read_text(), page)]


def command_lines(code: str) -> list[list[str]]:
    """The arguments after ``powertrain`` of each ``powertrain ...`` command line in a shell block (also ``python -m
    powertrain`` and ``torchrun ... -m powertrain``; continuation lines joined; ``$ `` prompts and output lines of a
    console block skipped)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.strip().removeprefix("$ ").split(" #", 1)[0]
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
            words.pop(0)
        if not words:
            continue
        if words[0] == "powertrain":
            out.append(words[1:])
        elif "-m" in words and words[words.index("-m") + 1 : words.index("-m") + 2] == ["powertrain"]:
            out.append(words[words.index("-m") + 2 :])
    return out


def test_readme_is_a_front_page():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size:,} bytes: move detail into docs/ (limit {README_LIMIT:,})"


def test_every_skipped_example_says_why_and_markers_sit_on_blocks():
    for page in PAGES:
        text = page.read_text()
        marked = [i for i, line in enumerate(text.splitlines()) if "<!-- example:" in line]
        for i in marked:
            assert _MARK.search(text.splitlines()[i]), f"{page.name}:{i + 1}: unknown example marker"
        fences = {b.line - 1 for b in blocks(text, page)}
        for i in marked:  # the marker is the line right before a fence
            assert i + 1 in fences, f"{page.name}:{i + 1}: an example marker not directly above a code block"


def test_every_command_line_shown_parses_with_the_current_flags():
    shown = [
        (b, argv)
        for b in _all_blocks()
        if b.lang in ("bash", "sh", "console", "shell")
        for argv in command_lines(b.code)
    ]
    assert shown, "no powertrain command line found in README.md or docs/"
    parser = build_parser()
    for block, argv in shown:
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"{block.name}: `powertrain {shlex.join(argv)}` does not parse") from e


def test_command_lines_are_found_the_way_a_reader_writes_them():
    """The extraction the test above relies on, on the forms the docs use."""
    code = (
        "$ powertrain train --steps 5\nOMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m powertrain train \\\n"
        "    --parallel ddp  # two workers\npython -m powertrain bench quality --preset tiny\nls runs/\n"
    )
    assert command_lines(code) == [
        ["train", "--steps", "5"],
        ["train", "--parallel", "ddp"],
        ["bench", "quality", "--preset", "tiny"],
    ]
    with pytest.raises(SystemExit):  # and a renamed flag is caught
        build_parser().parse_args(["train", "--sync-evry", "5"])


def _python_blocks() -> list[Block]:
    return [b for b in _all_blocks() if b.lang == "python"]


@pytest.mark.timeout(900)
def test_every_python_example_runs(tmp_path):
    """One test for all blocks (each a fresh process): a block that fails names its page and line."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    ran = 0
    for b in _python_blocks():
        if b.mark == "skip":
            continue
        # Each block in a directory of its own: what one writes (a checkpoint) must not be what another resumes from.
        here = tmp_path / f"{b.page.stem}_{b.line}"
        here.mkdir()
        script = here / "example.py"
        script.write_text(b.code)
        if b.mark.startswith("torchrun"):
            r = torchrun(script, nproc=int(b.mark.split()[1]), timeout=300, cwd=here)
        else:
            r = subprocess.run(
                [sys.executable, str(script)], cwd=here, env=env, capture_output=True, text=True, timeout=300
            )
        assert r.returncode == 0, f"{b.name}: the example failed:\n{r.stderr[-3000:]}"
        ran += 1
    assert ran, "no runnable example in README.md or docs/"


def test_every_torchrun_example_ends_without_the_interpreters_teardown():
    """Each torchrun block ends as docs/integrations.md#ending-a-torchrun-script says (gloo's teardown aborted a rank
    in 2 of 22 runs ending with destroy_process_group): a barrier, a flush, os._exit(0)."""
    ending = ["dist.barrier()", "sys.stdout.flush()", "os._exit(0)"]
    runs = [b for b in _python_blocks() if b.mark.startswith("torchrun")]
    assert runs
    for b in runs:
        last = [line.split("#")[0].strip() for line in b.code.strip().splitlines()[-3:]]
        assert last == ending, f"{b.name}: ends with {last}, not {ending}"


def test_a_broken_example_fails_the_check(tmp_path):
    """The check bites: a block calling a renamed function fails, naming its page and line."""
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nimport powertrain.compress as c\nc.make_compresor('int8', [])\n```\n")
    (b,) = blocks(page.read_text(), page)
    script = tmp_path / "b.py"
    script.write_text(b.code)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "make_compresor" in r.stderr and b.line == 3


def reference_modules() -> list[str]:
    """The modules the API reference documents: every ``automodule`` of docs/api/*.md."""
    pages = (ROOT / "docs" / "api").glob("*.md")
    return sorted({m for page in pages for m in re.findall(r"automodule:: ([\w.]+)", page.read_text())})


@pytest.mark.timeout(300)
def test_the_docs_build_with_no_warnings(tmp_path):
    pytest.importorskip("sphinx", reason="pip install -e '.[docs]'")
    pytest.importorskip("myst_parser", reason="pip install -e '.[docs]'")
    r = run_cli(
        "-b",
        "html",
        "-n",  # nitpicky: every reference to the project's own names resolves (docs/conf.py says what is left out)
        "-W",
        "--keep-going",
        "-q",
        "-c",
        str(ROOT / "docs"),
        str(ROOT),
        str(tmp_path / "html"),
        module="sphinx",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    api = (tmp_path / "html" / "docs" / "api" / "diloco.html").read_text()
    assert "powertrain.diloco.DiLoCo" in api and "sync_every" in api  # the reference is generated, not empty
    # every public name of every module the reference documents has its entry (a lazy export or an undocumented
    # constant is left out by autodoc without a warning)
    pages = list((tmp_path / "html" / "docs" / "api").glob("*.html"))
    ids = {i for page in pages for i in re.findall(r'id="(powertrain[\w.]+)"', page.read_text())}
    modules = reference_modules()
    assert len(modules) >= 10, modules
    missing = [
        f"{m}.{name}"
        for m in modules
        for name in getattr(importlib.import_module(m), "__all__", [])
        if f"{m}.{name}" not in ids
    ]
    assert not missing, f"public names missing from the API reference: {missing}"


# The modules whose ``__all__`` is the public API; hf and lightning are checked where their extra is installed.
PUBLIC_MODULES = [
    "powersgd",
    "compress",
    "ddp",
    "fsdp",
    "simple_fsdp",
    "rtp",
    "tp",
    "diloco",
    "checkpoint",
    "serialize",
    "comm",
    "optim",
    "hf",
    "lightning",
]
_EXTRAS = {"hf": "transformers", "lightning": "lightning"}


def _described(name: str, doc: str) -> bool:
    """An ``Args:`` entry ``name:`` (or ``*name:``, ``**name:``, ``name (type):``) or a ````name```` mention."""
    return bool(re.search(rf"^\s*\*{{0,2}}{re.escape(name)}( \(.*?\))?:", doc, re.M)) or f"``{name}``" in doc


def _has_field_comment(cls: type, name: str) -> bool:
    """A dataclass field ``name`` with a ``#:`` comment on the line right above it."""
    if not is_dataclass(cls):
        return False
    lines = inspect.getsource(cls).splitlines()
    return any(
        re.match(rf"\s*{re.escape(name)}\s*:", line) and lines[i - 1].strip().startswith("#:")
        for i, line in enumerate(lines[1:], 1)
    )


def undescribed_parameters(module: ModuleType) -> list[str]:
    """``module.Name(param)`` for each parameter of a public class (its ``__init__``'s, documented in the class's
    docstring or ``__init__``'s) or function that its docstring does not describe; ``self``, ``*args`` and ``_name``
    parameters need no entry, nor a class whose ``__init__`` is not powertrain's (object's, an exception's)."""
    out = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            fn = obj.__init__
            if not (getattr(fn, "__module__", None) or "").startswith("powertrain"):
                continue
            docs = [obj.__doc__, fn.__doc__]
        elif inspect.isroutine(obj):
            fn, docs = obj, [obj.__doc__]
        else:  # a constant, a type alias
            continue
        doc = "\n".join(inspect.cleandoc(d) for d in docs if d)
        for p in inspect.signature(fn).parameters.values():
            if p.name == "self" or p.name.startswith("_") or p.kind is p.VAR_POSITIONAL:
                continue
            if not (_described(p.name, doc) or (inspect.isclass(obj) and _has_field_comment(obj, p.name))):
                out.append(f"{module.__name__}.{name}({p.name})")
    return out


def test_every_public_parameter_is_described():
    """Every parameter of every public class and function has its description (an ``Args:`` entry, a ````name````
    in the prose, or a dataclass field's ``#:`` comment), so the API reference documents what each one does."""
    modules = [
        importlib.import_module(f"powertrain.{m}")
        for m in PUBLIC_MODULES
        if m not in _EXTRAS or importlib.util.find_spec(_EXTRAS[m]) is not None
    ]
    missing = [entry for module in modules for entry in undescribed_parameters(module)]
    assert not missing, f"parameters without a description in their docstring: {', '.join(missing)}"


def undocumented_members(module: ModuleType, exported: Collection[type] = ()) -> list[str]:
    """``module.Class.name`` for each public function or property (names not starting with ``_``) of a powertrain
    class in ``module.__all__`` without a docstring of its own: those the class defines, and those it inherits from a
    powertrain base that is not in ``exported`` (the classes the reference documents apart; autodoc's
    ``inherited-members`` lists an internal base's members on the class, not an exported base's)."""
    out = []
    for name in module.__all__:
        cls = getattr(module, name)
        if not (inspect.isclass(cls) and cls.__module__.startswith("powertrain")):
            continue
        seen: set[str] = set()
        for owner in cls.__mro__:  # the first definition of a name is the one the class has
            mine = owner is cls or (owner.__module__.startswith("powertrain") and owner not in exported)
            for attr, member in vars(owner).items():
                if attr in seen:
                    continue
                seen.add(attr)
                fn = member.__func__ if isinstance(member, staticmethod | classmethod) else member
                if not mine or attr.startswith("_"):
                    continue
                if not (inspect.isfunction(fn) or isinstance(fn, property | functools.cached_property)):
                    continue
                if not (fn.__doc__ or "").strip():
                    out.append(f"{module.__name__}.{name}.{attr}")
    return out


def test_every_public_method_and_property_has_a_docstring():
    """Every public method and property of every class the API reference documents has a docstring of its own:
    autodoc (``members`` without ``undoc-members``, ``autodoc_inherit_docstrings = False``) leaves one without it out
    of the reference, with no warning."""
    extra = {f"powertrain.{m}": package for m, package in _EXTRAS.items()}
    names = [m for m in reference_modules() if m not in extra or importlib.util.find_spec(extra[m]) is not None]
    assert len(names) >= 10, names
    modules = [importlib.import_module(m) for m in names]
    exported = {c for m in modules for n in m.__all__ if inspect.isclass(c := getattr(m, n))}
    missing = [entry for m in modules for entry in undocumented_members(m, exported)]
    assert not missing, f"public methods and properties without a docstring (left out of the API reference): {missing}"

    class A:
        def f(self) -> None:
            pass

        def g(self) -> None:
            """Documented."""

        def _h(self) -> None:
            pass

        @property
        def p(self) -> int:
            return 0

    class B(A):
        pass

    class C(B):
        def g(self) -> None:  # overrides A's documented g without a docstring
            pass

    # the check bites: an undocumented method or property is found, a documented or private one is not, and one
    # inherited from an exported base is that base's; from an internal base (B, C's if B is not exported) C's own
    sample = ModuleType("powertrain.sample")
    sample.A, sample.C, sample.__all__ = A, C, ["A", "C"]  # type: ignore[attr-defined]
    A.__module__ = B.__module__ = C.__module__ = sample.__name__
    found = ["powertrain.sample.A.f", "powertrain.sample.A.p", "powertrain.sample.C.g"]
    assert undocumented_members(sample, {A, C}) == found
    assert undocumented_members(sample, {C}) == [*found, "powertrain.sample.C.f", "powertrain.sample.C.p"]
