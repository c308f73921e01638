"""A griffe extension for the docs build: Sphinx roles in docstrings rendered as code.

gear_mpi's docstrings use Google sections (Args, Returns, Raises) and, in their prose, some
Sphinx cross-reference roles: ``:class:`~gear_mpi.replay.Replay```, ``:mod:`.plans```,
``:meth:`sample```, ``:data:`MODES```. Markdown has no such roles, so mkdocstrings would print
them as they are (``:class:`` before the code). This extension rewrites each into inline code,
before the docstrings are parsed: ``~a.b.C`` becomes ``C`` (Sphinx's short form), any other
target stays whole. No link is made, so a role naming a module that moved cannot break a
strict build.

mkdocs.yml loads it by path (``extensions: [scripts/docs/griffe_roles.py]``).
"""
from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|mod|meth|func|attr|data|obj|exc|const|ref|term):`([^`]+)`")


def plain(docstring: str) -> str:
    """``docstring`` with every Sphinx role replaced by inline code of its (short) target."""
    def code(m: re.Match) -> str:
        target = m[1].strip()
        if "<" in target and target.endswith(">"):  # :class:`text <target>`
            target = target[:target.index("<")].strip()
        if target.startswith("~"):
            target = target[1:].rsplit(".", 1)[-1]
        return f"`{target}`"
    return ROLE.sub(code, docstring)


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring as the objects are loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
