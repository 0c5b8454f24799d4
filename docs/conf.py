"""Sphinx configuration: the guides (Markdown, through MyST) and the API reference generated from the docstrings.

Built by ``make docs`` (warnings are errors) and by ``tests/test_docs.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import powertrain  # noqa: E402

project = "powertrain"
author = "the powertrain developers"
copyright = "2026, the powertrain developers"
release = version = powertrain.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
# The source directory is the repository's root (``sphinx -c docs .``), so that the guides' links to README.md,
# BENCHMARKS.md, SECURITY.md and DEVELOPERS.md resolve as they do on GitHub; only these files and docs/ are read.
root_doc = "docs/index"
include_patterns = ["README.md", "BENCHMARKS.md", "SECURITY.md", "DEVELOPERS.md", "docs/**"]
exclude_patterns = ["docs/_build"]
myst_heading_anchors = 3  # GitHub-style links to sections (guide.md#a-section) resolve in Sphinx too

# Every cross-reference to powertrain's own public names must resolve (-n; warnings are errors). Left unresolved on
# purpose: other projects' names (intersphinx would link torch's and Python's, but it downloads their inventories
# at build time, and the docs build offline), internal types that public signatures mention (a compressor's request
# types, the work split's blocks, the shared optimizer base), the command's models that tp's functions take, and
# the Literal aliases that signatures name.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|collections|pathlib|abc|typing|_thread|dist|transformers|lightning)(\..*)?"),
    (r"py:class", r"DeviceMesh|Trainer"),
    (
        r"py:.*",
        r"powertrain\.(_compat|models|compress\.(base|chain|feedback)|optim\.(matrices|distributor|shampoo\.stats))(\..*)?",
    ),
    (r"py:class", r"AdjustLR|Rule|Grafting|Method|Preconditioner|ProjType|SvdMethod|MomentsOnRefresh|OuterLRSchedule"),
]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Members a class inherits from an internal powertrain base (ErrorFeedbackCompressor's state_dict, MatrixOptimizer's
# add_param_group, Rewrapped's hooks) are documented on the class; those of other projects' bases, and of the
# documented public bases (Compressor, Aggregator, DeMo), are not repeated on each subclass.
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "inherited-members": "object,BaseException,ABC,Protocol,Generic,tuple,dict,Exception,ValueError,RuntimeError,"
    "FloatingPointError,KeyboardInterrupt,Optimizer,Module,Callback,TrainerCallback,DefaultLoadPlanner,_PyUnpickler,"
    "Compressor,Aggregator,DeMo",
}

html_theme = "furo"
html_title = f"powertrain {version}"
autodoc_inherit_docstrings = False  # torch base classes document their own methods (in their own markup)


def _google_sections(app, what, name, obj, options, lines):  # type: ignore[no-untyped-def]
    """Napoleon's Google-style sections (Args:, Returns:, Raises:) for functions, classes and modules only: on an
    attribute's ``#:`` comment it would take the text before the first colon for a type."""
    if what in ("attribute", "data", "property"):
        return
    from sphinx.ext.napoleon import Config, GoogleDocstring

    lines[:] = GoogleDocstring(
        lines, Config(napoleon_use_param=True, napoleon_use_rtype=True), app, what, name, obj, options
    ).lines()


def _front_door(app, exception):  # type: ignore[no-untyped-def]
    """index.html at the top of the built site, leading to docs/index.html (the root document lives in docs/)."""
    if exception is None and app.builder.format == "html":
        target = '<meta http-equiv="refresh" content="0; url=docs/index.html"><a href="docs/index.html">powertrain</a>'
        (Path(app.outdir) / "index.html").write_text(f"<!DOCTYPE html><html><head>{target}</head></html>\n")


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("autodoc-process-docstring", _google_sections)
    app.connect("build-finished", _front_door)
