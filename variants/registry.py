"""Name -> variant class registry, filled by ``@register`` and by third-party entry points.

Third-party packages add variants without editing this repo by declaring, in their own
``pyproject.toml``::

    [project.entry-points."attnbench.variants"]
    my_attention = "my_package.my_module"          # a module whose import runs @register
    # or  my_attention = "my_package.my_module:MyAttention"   # a class; registered under the key
"""

from __future__ import annotations

import fnmatch
import inspect
import re
import types
import typing
import warnings
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points

from .base import AttentionVariant

ENTRY_POINT_GROUP = "attnbench.variants"

_REGISTRY: dict[str, type[AttentionVariant]] = {}
#: name -> the installed distribution whose entry point registered it, as ``"<name> <version>"``
_PROVIDERS: dict[str, str] = {}
#: a variant's name: what ``variant=<name>`` and the tests' ids carry
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_entry_points_loaded = False


class UnknownVariant(KeyError):
    """Asked for a name nobody registered; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register(name: str) -> Callable[[type[AttentionVariant]], type[AttentionVariant]]:
    """Class decorator: register an :class:`AttentionVariant` subclass under ``name``."""

    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"variant name {name!r}: letters, digits, '_', '-' or '.', not empty (a command line says "
            "variant=<name>, and a sweep splits on commas)"
        )

    def deco(cls: type[AttentionVariant]) -> type[AttentionVariant]:
        if not (isinstance(cls, type) and issubclass(cls, AttentionVariant)):
            raise TypeError(f"@register('{name}') needs an AttentionVariant subclass, got {cls!r}")
        old = _REGISTRY.get(name)
        # the same class again (its module imported twice) keeps the name; any other class, even one
        # of the same name from another module, would silently replace what the name means
        if old is not None and _owner(old) != _owner(cls):
            raise ValueError(f"variant name '{name}' is already taken by {'.'.join(_owner(old))}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _owner(cls: type) -> tuple[str, str]:
    """Where ``cls`` is defined: its module and qualified name (a class name alone is not unique)."""
    return cls.__module__, cls.__qualname__


def unregister(name: str) -> None:
    """Remove ``name`` (for tests that register a throw-away variant)."""
    _REGISTRY.pop(name, None)
    _PROVIDERS.pop(name, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        before = dict(_REGISTRY)
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plugin must not take the suite down
            warnings.warn(
                f"could not load attention variant plugin '{ep.name}' ({ep.value}): {exc}", stacklevel=2
            )
            obj = None
        if isinstance(obj, type) and issubclass(obj, AttentionVariant):
            try:  # a name taken by another class, or one no command line can say: left out, saying so
                register(ep.name)(obj)
            except ValueError as exc:
                warnings.warn(
                    f"attention variant plugin '{ep.name}' ({ep.value}) left out: {exc}", stacklevel=2
                )
        # register() refuses another class under a taken name, but a plugin can still pass a class off
        # as the owner's (same module and name) or unregister it: the name keeps meaning what it meant
        replaced = [name for name, cls in before.items() if _REGISTRY.get(name) is not cls]
        for name in replaced:
            _REGISTRY[name] = before[name]
            warnings.warn(
                f"attention variant plugin '{ep.name}' ({ep.value}) tried to replace variant '{name}', "
                f"which stays {'.'.join(_owner(before[name]))}",
                stacklevel=2,
            )
        dist = getattr(ep, "dist", None)
        source = f"{dist.name} {dist.version}" if dist is not None else f"entry point {ep.value}"
        # its new names, and its own name where its module was imported (and registered) before
        mine = set(_REGISTRY) - set(before)
        top = ep.value.split(":")[0].strip().split(".")[0]
        if ep.name in _REGISTRY and _REGISTRY[ep.name].__module__.split(".")[0] == top:
            mine.add(ep.name)
        for name in mine:
            _PROVIDERS[name] = source
        if obj is not None and not replaced and ep.name not in _REGISTRY:  # a module that registered
            # nothing, or registered under another name
            warnings.warn(
                f"attention variant plugin '{ep.name}' ({ep.value}) loaded but registered no variant "
                f"named '{ep.name}': point the entry point at the class, or decorate it with "
                f"@register('{ep.name}')",
                stacklevel=2,
            )


def available(pattern: str = "*") -> list[str]:
    """Sorted registered names matching the glob ``pattern`` (entry points included)."""
    _load_entry_points()
    return sorted(n for n in _REGISTRY if fnmatch.fnmatchcase(n, pattern))


def builtin(pattern: str = "*") -> list[str]:
    """Sorted names matching ``pattern`` whose class this package defines: the variants the
    repository's own regression gates and committed tables cover (a third party's, registered by
    entry point, are checked by the registry-wide tests wherever they are installed, and gated in
    their own repository)."""
    package = __name__.split(".")[0]
    return [n for n in available(pattern) if _REGISTRY[n].__module__.split(".")[0] == package]


def provider(name: str) -> str | None:
    """The installed package (``"dilated-attn 0.2.0"``: distribution and version) whose entry point
    registered ``name``, or None for a variant registered otherwise (a built-in one, or a class a test
    registered by hand). A record carries it: two versions of a plugin share this repository's commit,
    so without it a comparison could not say which version each side ran."""
    _load_entry_points()
    return _PROVIDERS.get(name) if name in _REGISTRY else None


def get(name: str) -> type[AttentionVariant]:
    """The class registered as ``name``; :class:`UnknownVariant` lists the known names."""
    _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(available())
        raise UnknownVariant(f"unknown attention variant '{name}'; known variants: {known}") from None


def registered_name(cls: type) -> str | None:
    """The name ``cls`` itself is registered under, or None (a subclass of a registered variant is
    not that variant: it inherits ``name`` but is not in the registry under it)."""
    _load_entry_points()
    name = getattr(cls, "name", "")
    return name if name and _REGISTRY.get(name) is cls else None


SHAPE_HINTS = ("heads", "head_dim")  # workload sizes a learned variant needs; dropped by others


def config_knobs(variant_cfg: Mapping[str, object]) -> dict[str, object]:
    """A variant config's knobs: the config without ``_target_`` (which class) and the workload sizes
    it is handed (:data:`SHAPE_HINTS`), in the config's order. What a label, a record's ``knobs``
    column and a task's variant settings show."""
    return {k: v for k, v in variant_cfg.items() if k != "_target_" and k not in SHAPE_HINTS}


def knob_label(name: str, knobs: Mapping[str, object]) -> str:
    """``name(k=v, ...)``, or ``name`` when there are no knobs: how a variant setting is written in
    job labels and tables."""
    return name + (f"({', '.join(f'{k}={v}' for k, v in knobs.items())})" if knobs else "")


def knob_defaults(cls: type[AttentionVariant]) -> dict[str, object]:
    """The constructor's knobs and their defaults (``inspect.Parameter.empty`` where there is none)."""
    params = inspect.signature(cls.__init__).parameters
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n: p.default for n, p in params.items() if n != "self" and p.kind not in skip}


def _allowed_types(hint: object) -> tuple[type, ...] | None:
    """Python types a knob annotated ``hint`` accepts (None: not checked). int excludes bool; a float
    knob takes an int."""
    args = (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        else (hint,)
    )
    out: list[type] = []
    for a in args:
        if a is type(None) or a in (int, bool, str):
            out.append(a)
        elif a is float:
            out += [float, int]
        else:
            return None
    return tuple(out)


def check_knobs(cls: type[AttentionVariant], knobs: dict[str, object], label: str) -> None:
    """Raise ``ValueError`` (one line) for a knob ``cls`` does not take or a value of the wrong type.

    ``label`` names the variant in the message. Shape hints and ``_target_`` are not knobs.
    """
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = list(knob_defaults(cls))
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # unresolvable annotations: names are still checked
        hints = {}
    for key, value in knobs.items():
        if key == "_target_" or (key in SHAPE_HINTS and key not in params):
            continue
        if key not in params:
            if takes_any:
                continue
            raise ValueError(f"unknown knob '{key}' for {label}; knobs: {', '.join(accepted) or 'none'}")
        allowed = _allowed_types(hints.get(key))
        if allowed is None:
            continue
        wrong_bool = isinstance(value, bool) and bool not in allowed
        if wrong_bool or not isinstance(value, allowed):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in dict.fromkeys(allowed))
            raise ValueError(f"{label} knob {key} must be {names}, got {value!r}")


def build(name: str, **knobs: object) -> AttentionVariant:
    """Instantiate variant ``name`` with its knobs.

    Knobs the constructor does not take are dropped only if they are the shape hints ``heads`` and
    ``head_dim`` (which learned variants need); any other unknown knob is an error.
    """
    return construct(get(name), **knobs)


def construct(cls: type[AttentionVariant], **knobs: object) -> AttentionVariant:
    """``cls(**knobs)``, registered or not, with the shape hints dropped as :func:`build` does."""
    name = getattr(cls, "name", "") or cls.__name__
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for hint in ("heads", "head_dim"):
        if hint in knobs and hint not in params and not takes_any:
            knobs.pop(hint)
    unknown = [k for k in knobs if k not in params and not takes_any]
    if unknown:
        accepted = [p for p in params if p != "self"]
        raise TypeError(f"variant '{name}' has no knob(s) {unknown}; it takes {accepted}")
    return cls(**knobs)
