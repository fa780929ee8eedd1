"""The modules of `eqx_models` follow Equinox's abstract/final pattern: a class that
is subclassed is abstract (it has abstract methods or `eqx.AbstractVar` fields), and a
subclass never overrides a concrete method of its abstract base. So a block's shared
behaviour is written once, and what differs is declared as abstract and implemented
once, in each final class. The blocks find what a module can do by its type, never by
probing for a method (`hasattr`)."""

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import equinox as eqx
import pytest

import eqx_models
from eqx_models.axes import AbstractHasArrayAxes


def _modules() -> list:
    names = [info.name for info in pkgutil.walk_packages(eqx_models.__path__, "eqx_models.")]
    return [importlib.import_module(name) for name in ["eqx_models", *names] if not name.endswith(".__main__")]


def _classes() -> list[type]:
    """Every `eqx.Module` class defined in `eqx_models`."""
    found = {}
    for module in _modules():
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, eqx.Module) and value.__module__.startswith("eqx_models"):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return list(found.values())


def _is_abstract(cls: type) -> bool:
    return bool(cls.__abstractmethods__ or cls.__abstractvars__ or cls.__abstractclassvars__)


def _concrete_methods(cls: type) -> set[str]:
    """The methods (properties, static and class methods included) that `cls` itself
    defines and does not leave abstract; dunders other than `__call__` are the
    dataclass's own."""
    names = set()
    for name, value in vars(cls).items():
        if name.startswith("__") and name != "__call__":
            continue
        is_method = callable(value) or isinstance(value, (staticmethod, classmethod, property))
        if is_method and not getattr(value, "__isabstractmethod__", False):
            names.add(name)
    return names


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


CLASSES = _classes()


def test_the_classes_are_found():
    names = {_name(cls) for cls in CLASSES}
    assert "eqx_models.nn.attention.Attention" in names and "eqx_models.models.qwen3_next.Qwen3NextBlock" in names


@pytest.mark.parametrize("cls", CLASSES, ids=_name)
def test_a_subclassed_class_is_abstract(cls):
    """No concrete `eqx_models` class is extended (Equinox: every concrete class is final)."""
    bases = [base for base in cls.__mro__[1:] if base in CLASSES and not _is_abstract(base)]
    assert not bases, f"{_name(cls)} subclasses the concrete {[_name(b) for b in bases]}; subclass an abstract base."


@pytest.mark.parametrize("cls", [c for c in CLASSES if _is_abstract(c)], ids=_name)
def test_concrete_methods_of_an_abstract_class_are_not_overridden(cls):
    """An abstract class's concrete methods are shared as they are; what a subclass
    changes is an abstract method."""
    methods = _concrete_methods(cls)
    overridden = sorted(
        f"{_name(sub)}.{name}"
        for sub in CLASSES
        if sub is not cls and issubclass(sub, cls)
        for name in methods & set(vars(sub))
    )
    assert not overridden, f"{_name(cls)}'s concrete methods are overridden: {overridden}."


@pytest.mark.parametrize("cls", [c for c in CLASSES if _is_abstract(c)], ids=_name)
def test_an_abstract_class_declares_no_fields(cls):
    """Fields (and so `__init__`) belong to the final class; a base names what it
    reads as `eqx.AbstractVar`."""
    fields = [field.name for field in dataclasses.fields(cls)]
    assert not fields, f"{_name(cls)} is abstract but declares the fields {fields}."


@pytest.mark.parametrize("cls", [c for c in CLASSES if _is_abstract(c)], ids=_name)
def test_an_abstract_class_is_named_so(cls):
    assert cls.__name__.startswith("Abstract"), f"{_name(cls)} is abstract: name it Abstract{cls.__name__}."


@pytest.mark.parametrize("cls", [c for c in CLASSES if "array_axes" in vars(c)], ids=_name)
def test_a_module_declaring_array_axes_extends_the_base(cls):
    """Sharding reads `array_axes()` only from an `AbstractHasArrayAxes`: on any other
    module the method would be ignored, and its arrays reported as undeclared."""
    assert issubclass(cls, AbstractHasArrayAxes), f"{_name(cls)} defines array_axes: extend AbstractHasArrayAxes."


PACKAGE = Path(eqx_models.__file__).parent
# The blocks, the caches, and the code that walks them (sharding).
BLOCK_SOURCES = sorted([*(PACKAGE / "nn").glob("*.py"), *(PACKAGE / "models").glob("*.py"),
                        PACKAGE / "cache.py", PACKAGE / "paged_cache.py", PACKAGE / "sharding.py"])


@pytest.mark.parametrize("path", BLOCK_SOURCES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_blocks_do_not_probe_for_methods(path):
    """`hasattr` on a module is a protocol nobody declared: ask its abstract base instead."""
    calls = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"
    ]
    assert not calls, f"{path.name} calls hasattr on lines {calls}; use isinstance on an abstract base."
