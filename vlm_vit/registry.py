"""One tiny registry class: `register(name)`, `get(name)`, `names()`.

Third-party entries come through `importlib.metadata` entry points, read on the first
lookup and never at import.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any


class UnknownNameError(KeyError):
    """An unknown name; the message lists the close matches."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def unknown_name_error(kind: str, name: str, known: Iterable[str]) -> UnknownNameError:
    """Builds the error for an unknown `name` of `kind`, naming the close matches."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return UnknownNameError(f"unknown {kind} {name!r}{hint} (known: {', '.join(known)})")


def _source_of(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or "?"
    qualname = getattr(obj, "__qualname__", None) or repr(obj)
    try:
        where = f" ({inspect.getsourcefile(obj)})"
    except TypeError:
        where = ""
    return f"{module}.{qualname}{where}"


class Registry:
    """Names to objects for one kind of thing (poolers, converters, ...).

    Args:
        kind: what the entries are, used in error messages ("pooler").
        entry_point_group: the `importlib.metadata` group read lazily on the first lookup.
    """

    def __init__(self, kind: str, entry_point_group: str | None = None) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._entries: dict[str, Any] = {}
        self._sources: dict[str, str] = {}
        self._plugins_loaded = entry_point_group is None

    def register(self, name: str, *, source: str | None = None) -> Callable[[Any], Any]:
        """A decorator that registers its target under `name`.

        Raises:
            ValueError: when `name` is taken, naming both sources.
        """

        def decorate(obj: Any) -> Any:
            self.add(name, obj, source=source)
            return obj

        return decorate

    def add(self, name: str, obj: Any, *, source: str | None = None) -> None:
        """Registers `obj` under `name` (see `register`)."""
        source = source or _source_of(obj)
        if name in self._entries:
            raise ValueError(
                f"{self.kind} {name!r} is registered twice: by {self._sources[name]} "
                f"and by {source}"
            )
        self._entries[name] = obj
        self._sources[name] = source

    def get(self, name: str) -> Any:
        """The entry named `name`.

        Raises:
            UnknownNameError: listing the close matches.
        """
        if name not in self._entries:
            self._load_plugins()
        if name not in self._entries:
            raise unknown_name_error(self.kind, name, self._entries)
        return self._entries[name]

    def names(self) -> list[str]:
        """Every registered name, plugins included, sorted."""
        self._load_plugins()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self._load_plugins()
        return name in self._entries

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for entry in metadata.entry_points(group=self.entry_point_group):
            dist = getattr(entry.dist, "name", None) or "an unknown distribution"
            source = f"{entry.value} (plugin from {dist})"
            # A broken plugin warns and is skipped; the other entries keep working.
            try:
                self.add(entry.name, entry.load(), source=source)
            except Exception as error:
                warnings.warn(
                    f"{self.kind} plugin {entry.name!r} from {dist} ({entry.value}) was not "
                    f"loaded: {type(error).__name__}: {error}", RuntimeWarning, stacklevel=3,
                )
