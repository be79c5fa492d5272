"""Load, merge, check and instantiate YAML configs; every error names the key path and its file.

A config is data: nodes of the form `{target: dotted.path, params: {...}}` are checked against the
target's signature (unknown parameters, wrong types, missing files) before anything is built. This
module knows no section of ours; the rules of a training config are `ldm.training.checks`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NewType, TypedDict, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

ExistingPath = NewType("ExistingPath", str)
"""A parameter annotated with this must name a file or folder that exists."""


class ConfigError(ValueError):
    """A user mistake in a config file or a command-line override."""


class ConfigErrors(ConfigError):
    """Several mistakes found by one check, one line each (`str` joins them with newlines)."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


class Problems:
    """Collect the errors of independent checks (`with problems.check(): ...`); `raise_any()` raises them all."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    @contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except ConfigError as err:
            for one in err.errors if isinstance(err, ConfigErrors) else [err]:
                if str(one) not in map(str, self.errors):
                    self.errors.append(one)

    def raise_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigErrors(self.errors)


class TargetSpec(TypedDict, total=False):
    """A `{target, params}` node: a class or function to import and the arguments to call it with."""

    target: str
    params: dict


@dataclass(frozen=True)
class Supplied:
    """Mark a `TargetSpec` whose target receives these arguments from code, not from the config."""

    names: tuple[str, ...]


def supplied(*names: str) -> Any:
    """`TargetSpec` whose target gets `names` from the calling code: `Annotated[TargetSpec, Supplied]`."""
    return Annotated[TargetSpec, Supplied(names)]


@dataclass
class Sources:
    """Which file (or the command line) set each key, so errors can say where a value came from."""

    layers: list[tuple[str, set[str]]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # keys left `???`: the check reports them with the rest

    def add(self, name: str, cfg: DictConfig) -> None:
        self.layers.append((name, set(_flat_keys(OmegaConf.to_container(cfg)))))

    def where(self, key: str) -> str:
        """The last source that set `key` or one of its parents/children."""
        key = key.split("[")[0]
        for name, keys in reversed(self.layers):
            if any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in keys):
                return name
        return "defaults"


def _flat_keys(node: Any, prefix: str = "") -> typing.Iterator[str]:
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from _flat_keys(v, f"{prefix}{k}.")
        if not node and prefix:
            yield prefix[:-1]
    elif prefix:
        yield prefix[:-1]


def load_config(files: Sequence[str | os.PathLike], overrides: Sequence[str] = ()) -> tuple[DictConfig, Sources]:
    """Merge YAML `files` in order, then dotted `key.path=value` overrides; later ones win.

    Values left unset (`???`) are listed in `sources.missing`, for the check to report with every other mistake."""
    sources = Sources()
    layers = []
    for path in files:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            cfg = OmegaConf.load(path)
        except Exception as err:  # yaml.YAMLError and OmegaConf errors; both name the line
            raise ConfigError(f"{path}: not valid YAML: {_one_line(err)}") from None
        if not isinstance(cfg, DictConfig):
            raise ConfigError(f"{path}: a config must be a mapping of sections, got a list")
        sources.add(str(path), cfg)
        layers.append(cfg)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"command line: override {item!r} must look like key.path=value")
    if overrides:
        try:
            cli = OmegaConf.from_dotlist(list(overrides))
        except OmegaConfBaseException as err:
            raise ConfigError(f"command line: cannot parse overrides: {_one_line(err)}") from None
        sources.add("command line", cli)
        layers.append(cli)
    try:
        merged = OmegaConf.merge(*layers) if layers else OmegaConf.create()
        sources.missing = sorted(OmegaConf.missing_keys(merged))
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot merge configs: {_one_line(err)}") from None
    return merged, sources


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def import_target(path: str, key: str = "target", sources: Sources | None = None) -> Any:
    """Import `package.module.Name`; a bad path is a `ConfigError` naming the key."""
    module_name, _, attr = str(path).rpartition(".")
    if not module_name:
        fail(sources, key, f"target {path!r} must be a dotted path like package.module.Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        fail(sources, key, f"cannot import {path!r}: {_one_line(err)}")
    try:
        return getattr(module, attr)
    except AttributeError:
        fail(sources, key, f"cannot import {path!r}: module {module_name!r} has no {attr!r}")
    except ImportError as err:  # a lazily imported optional dependency, e.g. ldm.training.strategies.ColossalAIStrategy
        fail(sources, key, f"cannot import {path!r}: {_one_line(err)}")


def check_target_node(node: Any, key: str, sources: Sources | None = None, supplied: Sequence[str] = ()) -> None:
    """Check one `{target, params}` node and, recursively, the nodes inside its params.

    `supplied` names arguments the calling code passes; the config may not set them.
    """
    if not isinstance(node, Mapping) or "target" not in node:
        fail(sources, key, "must be a mapping with a `target` (and optional `params`)")
    problems = Problems()
    for k in node:
        if k not in ("target", "params"):
            with problems.check():
                fail(sources, f"{key}.{k}", "unknown key; a target node has only `target` and `params`")
    with problems.check():
        target = import_target(node["target"], f"{key}.target", sources)
        params = node.get("params") or {}
        if not isinstance(params, Mapping):
            fail(sources, f"{key}.params", f"must be a mapping, got {_show(params)}")
        if not callable(target):
            fail(sources, f"{key}.target", f"{node['target']} is not a class or function to call")
    problems.raise_any()
    sig = signature(target)
    positional = [n for n, p in sig.parameters.items() if n != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]
    if supplied and positional and supplied[0] not in sig.parameters:
        # The code passes its first argument by position; the target may call it differently
        # (optimizers: `params` in torch, `model_params` in Colossal-AI).
        supplied = (positional[0], *supplied[1:])
    for name in supplied:
        if name in params:
            with problems.check():
                fail(sources, f"{key}.params.{name}", "is set by the code that builds this target; remove it")
    with problems.check():
        check_params(params, sig, f"{key}.params", sources, skip=supplied, supplied=supplied)
    problems.raise_any()


def signature(target: Any) -> inspect.Signature:
    sig = inspect.signature(target)
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target, include_extras=True)
    except Exception:
        hints = {}
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()]
    return sig.replace(parameters=params)


def check_params(
    params: Mapping,
    sig: inspect.Signature,
    key: str,
    sources: Sources | None = None,
    skip: Sequence[str] = (),
    supplied: Sequence[str] = (),
) -> None:
    """Check `params` against a signature: unknown names, missing required ones, value types; every
    mistake is reported (`ConfigErrors`), not only the first."""
    accepted = {n: p for n, p in sig.parameters.items() if n != "self"}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    problems = Problems()
    for name, value in params.items():
        where = f"{key}.{name}"
        if name in skip:
            continue
        with problems.check():
            if name not in accepted or accepted[name].kind in (
                accepted[name].VAR_POSITIONAL,
                accepted[name].VAR_KEYWORD,
            ):
                if takes_kwargs:
                    continue
                valid = ", ".join(
                    n for n, p in accepted.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in skip
                )
                fail(sources, where, f"unknown parameter; valid: {valid}")
            check_value(value, accepted[name].annotation, where, sources)
    for name, p in accepted.items():
        required = p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        unset = sources is not None and f"{key}.{name}" in sources.missing  # reported as unset already
        if required and name not in params and name not in supplied and not unset:
            with problems.check():
                fail(sources, f"{key}.{name}", "missing required parameter")
    problems.raise_any()


def check_value(value: Any, annotation: Any, key: str, sources: Sources | None = None) -> None:
    """Check one value against a type annotation (a subset of typing that configs use)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return
    if _matches(value, annotation, key, sources):
        return
    fail(sources, key, f"expected {_type_name(annotation)}, got {_show(value)}")


def _matches(value: Any, ann: Any, key: str, sources: Sources | None) -> bool:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Annotated:
        marks = [m for m in ann.__metadata__ if isinstance(m, Supplied)]
        if marks and isinstance(value, Mapping):
            check_target_node(value, key, sources, marks[0].names)
            return True
        return _matches(value, args[0], key, sources)
    if ann is ExistingPath:
        if not isinstance(value, (str, os.PathLike)):
            return False
        if not Path(value).expanduser().exists():
            fail(sources, key, f"no such file or folder: {value}")
        return True
    if ann is type(None) or ann is None:
        return value is None
    if origin in (Union, types.UnionType):
        errors = []
        for arg in args:
            try:
                if _matches(value, arg, key, sources):
                    return True
            except ConfigError as err:
                errors.append(err)
        if errors:
            raise errors[0]
        return False
    if origin is Literal:
        if value not in args:
            fail(sources, key, f"got {_show(value)}; valid: {', '.join(map(repr, args))}")
        return True
    if _is_typeddict(ann):
        if not isinstance(value, Mapping):
            return False
        hints = typing.get_type_hints(ann)
        problems = Problems()
        for k, v in value.items():
            with problems.check():
                if k not in hints:
                    fail(sources, f"{key}.{k}", f"unknown key; valid: {', '.join(hints)}")
                check_value(v, hints[k], f"{key}.{k}", sources)
        problems.raise_any()
        if ann is TargetSpec:
            check_target_node(value, key, sources)
        return True
    if ann is bool:
        return isinstance(value, bool)
    if ann is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if ann is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if ann is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence) or ann in (list, tuple):
        if not isinstance(value, (list, tuple, ListConfig)):
            return False
        item = args[0] if args and (origin is not tuple or len(args) == 2 and args[1] is Ellipsis) else Any
        for i, v in enumerate(value):
            check_value(v, item, f"{key}[{i}]", sources)
        return True
    if origin in (dict, Mapping) or ann in (dict, Mapping):
        return isinstance(value, (Mapping, DictConfig))
    # Classes (modules, callables, ...) cannot come from YAML except as a target node.
    if inspect.isclass(ann):
        if isinstance(value, Mapping) and "target" in value and not isinstance(value, ann):
            check_target_node(value, key, sources)  # a node the object will be built from: read it like any other
            return True
        return isinstance(value, ann)
    return True


def _is_typeddict(ann: Any) -> bool:
    return typing.is_typeddict(ann)


def _type_name(ann: Any) -> str:
    if ann is ExistingPath:
        return "a path"
    if typing.get_origin(ann) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(ann))
    if ann is type(None):
        return "null"
    if typing.get_origin(ann) in (list, tuple, Sequence):
        return "a list"
    if typing.get_origin(ann) in (dict, Mapping) or _is_typeddict(ann):
        return "a mapping"
    return getattr(ann, "__name__", str(ann))


def _show(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return f"{type(value).__name__} {value!r}" if not isinstance(value, (dict, list)) else f"{value!r}"


def fail(sources: Sources | None, key: str, message: str) -> typing.NoReturn:
    """Raise a `ConfigError` for `key`, saying which file (or the command line) set it."""
    where = f" ({sources.where(key)})" if sources else ""
    raise ConfigError(f"{key}{where}: {message}")


def to_plain(node: Any) -> Any:
    """An OmegaConf node as plain dicts and lists (for calling code and for checkpoints)."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def instantiate(
    node: Any, key: str = "", rejections: tuple[type[BaseException], ...] = (ValueError,), **extra: Any
) -> Any:
    """Build `target(**params, **extra)` from a `{target, params}` node.

    A value the target rejects (one of `rejections`) becomes a `ConfigError` naming the key path of the
    value (see `rejected`)."""
    target = import_target(node["target"], f"{key}.target")
    params = to_plain(node.get("params") or {})
    try:
        return target(**params, **extra)
    except ConfigError:
        raise
    except rejections as err:
        raise rejected(key, err, target) from None


def rejected(key: str, err: BaseException, target: Any = None) -> ConfigError:
    """A `ConfigError` for a value that the code built from the node at `key` refused with `err`.

    A message that starts with a key path of the node's section is kept; one that starts with the name
    of one of `target`'s parameters (`root: no images in ...`) gets that parameter's key path
    (`data.params.dataset.params.root: ...`); any other is put after `key`."""
    message = _one_line(err)
    section = key.split(".")[0]
    if section and re.match(rf"^{re.escape(section)}\.[\w.\[\]]+[: ]", message):
        return ConfigError(message)
    named = re.match(r"^(\w+)(?=:| must )", message)
    if named and target is not None and named[1] in signature(target).parameters:
        return ConfigError(f"{key}.params.{message}")
    return ConfigError(f"{key}: {message}")
