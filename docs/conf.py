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
copyright = "2026, the powertrain developers"  # noqa: A001
release = version = powertrain.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # GitHub-style links to sections (guide.md#a-section) resolve in Sphinx too

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

html_theme = "furo"
html_title = f"powertrain {version}"
autodoc_inherit_docstrings = False  # torch base classes document their own methods (in their own markup)


def _google_sections(app, what, name, obj, options, lines):  # type: ignore[no-untyped-def]
    """Napoleon's Google-style sections (Args:, Returns:, Raises:) for functions, classes and modules only: on an
    attribute's ``#:`` comment it would take the text before the first colon for a type."""
    if what in ("attribute", "data", "property"):
        return
    from sphinx.ext.napoleon import Config, GoogleDocstring

    lines[:] = GoogleDocstring(lines, Config(napoleon_use_param=True, napoleon_use_rtype=True), app, what, name, obj,
                               options).lines()  # fmt: skip


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("autodoc-process-docstring", _google_sections)
