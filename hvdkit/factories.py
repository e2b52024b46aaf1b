"""Your own objects by import path: ``pkg.module:fn`` or ``path/to/file.py:fn``, with arguments.

``--model``, ``--dataset``, ``--task`` and ``--optimizer`` take such a path; ``--model-arg
key=value`` (and ``model_args:`` in ``--config``) give the factory its keyword arguments.
Values are read as YAML scalars, so ``num_classes=10`` is an int, ``dropout=0.1`` a float,
``bias=false`` a bool.

Two levels of checking, both before the first step:

* :func:`check_static` runs when a job script or launch line is generated (``hvdkit slurm``,
  ``hvdkit run``): it finds the module's file *without importing it* (no torch on a login
  node), and when the function is defined there, checks the arguments against its
  signature by reading the source.
* :func:`resolve` imports the object on the ranks (``hvdkit train``) and checks the
  arguments against the real signature.

Every failure is one :class:`~hvdkit.errors.ConfigError` naming the path and what was wrong.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, first_line

__all__ = ["ImportPath", "is_import_path", "parse_import_path", "parse_args", "format_args",
           "check_static", "resolve", "call"]

_MODULE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_ATTR = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


@dataclass(frozen=True)
class ImportPath:
    """A parsed ``module:attr`` or ``file.py:attr``."""

    text: str
    module: str | None   # dotted module name, or None for a file
    file: Path | None    # a .py file, or None for a module
    attr: str            # possibly dotted: Class.method


def is_import_path(value: str) -> bool:
    """True when ``value`` names an object by import path (it holds a ':')."""
    return ":" in value


def parse_import_path(value: str, what: str = "--model") -> ImportPath:
    """Parse ``value``; a ConfigError names ``what`` and the form expected."""
    target, _, attr = value.rpartition(":")
    form = "use pkg.module:function or path/to/file.py:function"
    if not target or not _ATTR.match(attr):
        raise ConfigError(f"{what} {value!r} is not an import path", form)
    if target.endswith(".py"):
        return ImportPath(value, None, Path(target), attr)
    if not _MODULE.match(target):
        raise ConfigError(f"{what} {value!r}: {target!r} is not a module name", form)
    return ImportPath(value, target, None, attr)


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_args(items: Iterable[str] | Mapping[str, Any], what: str = "--model-arg") -> dict[str, Any]:
    """``["num_classes=10", "bias=false"]`` -> ``{"num_classes": 10, "bias": False}`` (YAML scalars).

    A mapping (from a config file) passes through with its keys checked.
    """
    import yaml

    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items:
            key, sep, raw = str(item).partition("=")
            if not sep:
                raise ConfigError(f"{what} {item!r} is not KEY=VALUE", f"e.g. {what} num_classes=10")
            try:
                value = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError:
                value = raw
            if isinstance(value, str) and _EXPONENT.fullmatch(raw.strip()):
                value = float(raw)  # YAML 1.1 reads 1e-6 (no dot) as a string
            pairs.append((key.strip(), value))
    out: dict[str, Any] = {}
    for key, value in pairs:
        if not str(key).isidentifier():
            raise ConfigError(f"{what} {key!r} is not a keyword argument name", f"e.g. {what} num_classes=10")
        if key in out:
            raise ConfigError(f"{what} {key} is given twice", "give each argument once")
        out[str(key)] = value
    return out


def format_args(args: Mapping[str, Any]) -> list[str]:
    """Inverse of :func:`parse_args` for the command line: ``['num_classes=10', ...]``."""
    import yaml

    return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
            for k, v in args.items()]


def _module_file(module: str) -> Path | None:
    """The source file of ``module``, found without importing it or its packages.

    Looks the top-level package up with ``find_spec`` (which imports nothing for a top-level
    name), then walks down its directories.
    """
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    for location in spec.submodule_search_locations or []:
        base = Path(location, *rest)
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.is_file():
                return cand
        if base.with_suffix(".so").exists() or list(base.parent.glob(base.name + ".*.so")):
            return base  # compiled: exists, not readable as source
    return None


@functools.lru_cache(maxsize=32)
def _parse_version(file: Path, version: tuple[int, int]) -> tuple[str, ast.Module]:
    source = file.read_text()
    return source, ast.parse(source, filename=str(file))


def _parse(file: Path) -> tuple[str, ast.Module]:
    """``file``'s source and syntax tree, parsed once per version of the file (one check reads
    a file up to three times: its syntax, where a name is defined, that definition's arguments).
    Raises what reading or parsing raises."""
    stat = file.stat()
    return _parse_version(file, (stat.st_mtime_ns, stat.st_size))


def _signature_from_source(file: Path, attr: str) -> ast.arguments | None:
    """The arguments of function (or class ``__init__``) ``attr`` defined at the top of ``file``."""
    try:
        _, tree = _parse(file)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    name = attr.split(".")[0]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name and "." not in attr:
            return node.args
        if isinstance(node, ast.ClassDef) and node.name == name and "." not in attr:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return item.args
            return None
    return None


def _find_definition(file: Path, name: str, module: str | None, depth: int = 0
                     ) -> tuple[Path, str] | bool | None:
    """Where ``name`` is defined, following ``from X import name`` and star imports a few levels.

    Returns ``(file, name)`` of the definition, ``True`` when it is bound but not by a
    ``def``/``class`` we can read, ``False`` when ``file`` surely does not bind it, ``None``
    when that cannot be told without importing.
    """
    try:
        source, tree = _parse(file)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    package = module if file.name == "__init__.py" else (module.rpartition(".")[0] if module else None)
    unsure = False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return file, name
        if isinstance(node, ast.ImportFrom):
            source_module = node.module or ""
            if node.level:
                if package is None:
                    unsure = True
                    continue
                base = package.split(".")
                base = base[: len(base) - node.level + 1] if node.level > 1 else base
                source_module = ".".join([*base, *([source_module] if source_module else [])])
            for alias in node.names:
                star = alias.name == "*"
                if not star and (alias.asname or alias.name) != name:
                    continue
                target = _module_file(source_module) if depth < 3 and source_module else None
                if target is None or target.suffix != ".py":
                    if star:
                        unsure = True
                        continue
                    return True
                found = _find_definition(target, name if star else alias.name, source_module, depth + 1)
                if found or found is None:
                    return found if found is not None else None
                if not star:
                    return True
        elif isinstance(node, ast.Import):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    if unsure or re.search(rf"\b{re.escape(name)}\b", source):
        return None  # bound some other way (globals(), a loop, a star import): let the import decide
    return False


def _check_names(what: str, path: ImportPath, params: list[str], has_kwargs: bool,
                 args: Mapping[str, Any], skip: int) -> None:
    params = params[skip:]
    unknown = [k for k in args if k not in params]
    if unknown and not has_kwargs:
        raise ConfigError(f"{what} {path.text} takes no argument {', '.join(map(repr, unknown))}",
                          f"its arguments are: {', '.join(params) or '(none)'}")


def check_static(value: str, args: Mapping[str, Any] | None = None, what: str = "--model",
                 skip: int = 0, base: Path | None = None) -> None:
    """Check an import path without importing anything (a login node, a job script).

    The module or file must exist; when the function is defined in that file, ``args`` must
    name its parameters (the first ``skip`` are positional ones hvdkit passes). What cannot
    be seen without importing (a re-exported name, a compiled module) is left to
    :func:`resolve` on the ranks.
    """
    path = parse_import_path(value, what)
    args = dict(args or {})
    if path.file is not None:
        file = path.file if path.file.is_absolute() or base is None else base / path.file
        if not file.is_file():
            raise ConfigError(f"{what} {value}: file {path.file} does not exist",
                              "give a path the compute nodes can see (relative to the working directory)")
    else:
        assert path.module is not None
        found = _module_file(path.module)
        if found is None:
            raise ConfigError(f"{what} {value}: module {path.module} cannot be found here",
                              "install it (pip install ...), or put its directory on PYTHONPATH")
        file = found
    if file.suffix != ".py":
        return
    try:  # a file that cannot even be parsed fails on every rank at import: say so now
        _parse(file)
    except SyntaxError as exc:
        raise ConfigError(f"{what} {value}: {file.name} line {exc.lineno}: SyntaxError: {exc.msg}",
                          "fix the file; 'python -m py_compile FILE' shows the same") from None
    except (OSError, UnicodeDecodeError, ValueError):
        pass  # unreadable here: resolve() on the ranks will say
    first, _, rest = path.attr.partition(".")
    defined = _find_definition(file, first, path.module)
    if defined is False:
        raise ConfigError(f"{what} {value}: {file.name} defines no {first!r}",
                          "check the name after ':'")
    if not isinstance(defined, tuple):
        return
    sig = _signature_from_source(defined[0], ".".join(filter(None, [defined[1], rest])))
    if sig is None:
        return
    positional = [a.arg for a in (*sig.posonlyargs, *sig.args)]
    if positional and positional[0] == "self":
        positional = positional[1:]
    params = positional + [a.arg for a in sig.kwonlyargs]
    _check_names(what, path, params, sig.kwarg is not None, args, skip)
    # required: positional ones without a default, after those hvdkit passes, and keyword-only
    # ones without one; an optimizer also gets lr from hvdkit (in args already, as resolve's)
    required = positional[skip:len(positional) - len(sig.defaults)] + \
        [a.arg for a, d in zip(sig.kwonlyargs, sig.kw_defaults) if d is None]
    missing = [name for name in required if name not in args]
    if missing and what != "--task":  # a task function gets (model, batch) from hvdkit itself
        flag = {"--model": "--model-arg", "--dataset": "--dataset-arg", "--optimizer": "--optimizer-arg"}.get(what)
        raise ConfigError(f"{what} {value} needs {', '.join(map(repr, missing))}, which nothing passes",
                          f"add {flag} {missing[0]}=VALUE" if flag else "give it a default")


def _import_file(file: Path) -> Any:
    name = f"hvdkit_user_{abs(hash(str(file.resolve()))):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # the file's own directory first, so it can import its neighbours
    sys.path.insert(0, str(file.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        try:
            sys.path.remove(str(file.resolve().parent))
        except ValueError:
            pass
    return module


def resolve(value: str, args: Mapping[str, Any] | None = None, what: str = "--model",
            skip: int = 0) -> Callable[..., Any]:
    """Import the object ``value`` names and check ``args`` against its signature.

    ``skip``: how many leading positional parameters hvdkit itself passes (an optimizer
    class gets the parameters first). Raises a one-line ConfigError when the module does
    not import, the name is missing, it is not callable, or an argument is unknown.
    """
    path = parse_import_path(value, what)
    try:
        if path.file is not None:
            if not path.file.is_file():
                raise ConfigError(f"{what} {value}: file {path.file} does not exist",
                                  "give a path relative to the working directory, or an absolute one")
            module = _import_file(path.file)
        else:
            module = importlib.import_module(path.module or "")
    except ConfigError:
        raise
    except SystemExit as exc:  # a script's exit at import: the user sees why, not a silent code
        raise ConfigError(f"{what} {value}: importing {path.file or path.module} called sys.exit({exc.code!r})",
                          "a module hvdkit imports must not exit at import: put its script part under "
                          "if __name__ == '__main__':") from None
    except Exception as exc:  # the user's module: any error, one line
        where = path.file or path.module
        raise ConfigError(f"{what} {value}: importing {where} failed: {type(exc).__name__}: "
                          f"{first_line(exc)}", "fix the module, or check PYTHONPATH and the venv") from None
    obj: Any = module
    for part in path.attr.split("."):
        if not hasattr(obj, part):
            # the module by the name the user gave (a file's is internal: hvdkit_user_<hash>)
            owner = (path.file or path.module) if obj is module else getattr(obj, "__name__", obj)
            raise ConfigError(f"{what} {value}: {owner} has no attribute {part!r}", "check the name after ':'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what} {value} is a {type(obj).__name__}, not something to call",
                          "name a function or class")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj  # a builtin without a signature: the call will tell
    params = list(sig.parameters.values())
    has_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    _check_names(what, path, names, has_kwargs, dict(args or {}), skip)
    return obj


def call(factory: Callable[..., Any], value: str, args: Mapping[str, Any], what: str,
         *positional: Any) -> Any:
    """``factory(*positional, **args)``; an exception it raises becomes one line naming it."""
    from .errors import HvdkitError

    try:
        return factory(*positional, **args)
    except HvdkitError:
        raise
    except SystemExit as exc:
        raise HvdkitError(f"{what} {value} called sys.exit({exc.code!r})",
                          "a factory must return its object (or raise), not exit the process") from None
    except Exception as exc:  # the user's code failed: say where, in one line
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
        raise HvdkitError(f"{what} {value}({shown}) raised {type(exc).__name__}: {first_line(exc)}",
                          "fix the factory or its arguments; run it alone in Python to see the traceback") from None
