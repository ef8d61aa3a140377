"""Configuration documented where users look: each field's docstring shown by ``help()``.

Config dataclasses document each field with an attribute docstring (a string right below the field), which
Python keeps nowhere at run time, so ``help(loom.DataParallel)`` showed none of them. `document_options` reads
them from the class's source once, at import, and appends ``name = default: meaning`` lines to the docstrings
of the config class and of the strategies that take its fields as keyword arguments.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from collections import ChainMap

__all__ = ["document_options", "field_docs"]


def field_docs(config: type) -> dict[str, str]:
    """``{field: its attribute docstring}`` of a dataclass and its dataclass bases (empty where the source cannot
    be read); a subclass's docstring wins over its base's."""
    return dict(ChainMap(*(_own_field_docs(c) for c in config.__mro__ if dataclasses.is_dataclass(c))))


def _own_field_docs(config: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(config)))
    except (OSError, TypeError):  # no source (a frozen application): the fields stay undocumented
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    return {
        node.target.id: " ".join(str(doc.value.value).split())
        for node, doc in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
    }


def _options(config: type) -> str:
    docs = field_docs(config)
    lines = []
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        lines.append(f"    {f.name} = {default}: {docs.get(f.name, '')}".rstrip(": "))
    return f"Options ({config.__name__}):\n" + "\n".join(lines)


def document_options(target: type, *configs: type) -> None:
    """Append the options of ``configs`` (their fields, defaults and meanings) to ``target.__doc__``."""
    sections = "\n\n".join(_options(c) for c in configs)
    target.__doc__ = f"{inspect.cleandoc(target.__doc__ or '')}\n\n{sections}\n"
