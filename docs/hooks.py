"""MkDocs hook: every public name an API page documents has a docstring.

mkdocstrings renders an undocumented function as a bare signature without a word; this hook
says so as a warning, which `mkdocs build --strict` turns into a failure. A module's public
names are its `__all__`, else the names it defines without a leading underscore; a class's
are its methods without one (`forward` excepted: the class docstring documents the call).
"""

from __future__ import annotations

import logging
import re

import griffe

log = logging.getLogger("mkdocs.hooks.docstrings")
IDENTIFIER = re.compile(r"^::: ([\w.]+)", re.MULTILINE)
SEARCH_PATHS = [".", "adapters/vlm-vit-llm"]


def undocumented(module: griffe.Module) -> list[str]:
    """The public names of `module` (and their public methods) that have no docstring."""
    if module.exports is not None:
        names = [name if isinstance(name, str) else name.name for name in module.exports]
    else:
        names = [name for name, member in module.members.items()
                 if not name.startswith("_") and not member.is_alias]
    missing = []
    for name in names:
        member = module.members.get(name)
        if member is None:
            continue
        target = member.final_target if member.is_alias else member
        if target.is_module or target.is_attribute:
            continue
        if not target.docstring:
            missing.append(f"{module.path}.{name}")
        if target.is_class:
            missing += [f"{module.path}.{name}.{method}"
                        for method, function in target.members.items()
                        if not method.startswith("_") and method != "forward"
                        and not function.is_alias and function.is_function
                        and not function.docstring]
    return missing


def on_page_markdown(markdown: str, page, config, files) -> str:
    for identifier in IDENTIFIER.findall(markdown):
        module = griffe.load(identifier, search_paths=SEARCH_PATHS, resolve_aliases=True,
                             resolve_external=False)
        for name in undocumented(module):
            log.warning("%s: %s has no docstring", page.file.src_path, name)
    return markdown
