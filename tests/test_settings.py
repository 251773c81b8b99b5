"""Every settings class of the product keeps one pattern: named ``Settings`` (or ``<Thing>Settings``;
the hook's user-facing ``Config``), a frozen keyword-only dataclass, a docstring under each field,
and numbers checked as it is made (``wire.settings.check_numbers``), refused in a message that
names the field."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

from rankscope.wire.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "profiler_hook", "aggregator", "diagnosis", "renderers", "api", "preflight", "rankscope")


def _settings_classes() -> list[tuple[str, ast.ClassDef]]:
    """(module, class) of each class of the product named ``*Settings`` or ``Config``."""
    out = []
    for package in PACKAGES:
        for f in sorted((ROOT / package).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            module = ".".join(("rankscope", *parts[parts[0] == "rankscope" :]))
            module = module.removesuffix(".__init__")
            for node in ast.parse(f.read_text()).body:
                if isinstance(node, ast.ClassDef) and (
                    node.name.endswith("Settings") or node.name == "Config"
                ):
                    out.append((module, node))
    return out


CLASSES = _settings_classes()


def test_the_settings_classes_are_found() -> None:
    names = {node.name for _, node in CLASSES}
    assert {"Config", "KafkaSettings", "ServeSettings", "TicketSettings", "StragglerSettings"} <= names
    assert len(CLASSES) >= 13


@pytest.mark.parametrize(("module", "node"), CLASSES, ids=[f"{m}.{n.name}" for m, n in CLASSES])
def test_a_settings_class_is_frozen_keyword_only_documented_and_checks_its_numbers(
    module: str, node: ast.ClassDef
) -> None:
    cls = getattr(importlib.import_module(module), node.name)
    params = cls.__dataclass_params__
    assert params.frozen and all(f.kw_only for f in dataclasses.fields(cls)), f"{node.name}: frozen, kw_only"
    body = node.body
    undocumented = [
        s.target.id  # type: ignore[union-attr]
        for i, s in enumerate(body)
        if isinstance(s, ast.AnnAssign)
        and not (
            i + 1 < len(body)
            and isinstance(body[i + 1], ast.Expr)
            and isinstance(body[i + 1].value, ast.Constant)  # type: ignore[attr-defined]
        )
    ]
    assert undocumented == [], f"{node.name}: a docstring under each field"
    required = {f.name: "kafka:9092" for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}  # fmt: skip
    default = cls(**required)
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        for bad in (-1, float("nan")):
            with pytest.raises(UsageError, match=rf"^{node.name}\.{f.name} must be"):
                cls(**required, **{f.name: bad})
