"""Settings: a small user configuration; every field has a default, a description and, where numeric, bounds."""

from __future__ import annotations

import re

import annotated_types
import pytest
from pydantic import BaseModel, ValidationError

from facegate.config import Settings


def _bounds(field) -> set[str]:
    kinds = set()
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge | annotated_types.Gt):
            kinds.add("lower")
        if isinstance(m, annotated_types.Le | annotated_types.Lt):
            kinds.add("upper")
    return kinds


def _all_fields() -> list[tuple[str, object]]:
    """``(dotted name, FieldInfo)`` of every top-level field and every field of the nested groups."""
    out = []
    for name, f in Settings.model_fields.items():
        out.append((name, f))
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out += [(f"{name}.{n}", g) for n, g in f.annotation.model_fields.items()]
    return out


FIELDS = dict(_all_fields())


def test_at_most_25_top_level_settings() -> None:
    assert len(Settings.model_fields) <= 25, sorted(Settings.model_fields)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_field_has_a_default_and_a_description(name: str) -> None:
    field = FIELDS[name]
    assert not field.is_required(), f"{name} has no default"
    assert field.description and len(field.description) > 15, f"{name} has no description"


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_no_description_cites_a_benchmark_run(name: str) -> None:
    text = FIELDS[name].description.lower()
    assert not re.search(r"\b(runs?|phase|session)s? \d", text), text
    assert "h200" not in text and "benchmarks/" not in text, text


@pytest.mark.parametrize("name", sorted(n for n, f in FIELDS.items() if f.annotation in (int, float)))
def test_every_numeric_field_is_bounded(name: str) -> None:
    assert _bounds(FIELDS[name]) == {"lower", "upper"}, f"{name} lacks a bound"


def test_a_value_out_of_bounds_is_refused() -> None:
    with pytest.raises(ValidationError):
        Settings(detector={"nms_threshold": 1.5})
    with pytest.raises(ValidationError):
        Settings(limits={"max_queue": 0})


def test_the_json_limit_fits_the_body_limit_of_routes_without_images() -> None:
    """A larger json_max_bytes would be accepted and have no effect: such bodies are cut at SMALL_BODY_BYTES."""
    from facegate.api.app import SMALL_BODY_BYTES

    assert Settings(limits={"json_max_bytes": SMALL_BODY_BYTES}).limits.json_max_bytes == SMALL_BODY_BYTES
    with pytest.raises(ValidationError):
        Settings(limits={"json_max_bytes": SMALL_BODY_BYTES + 1})


def test_nested_groups_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACEGATE_LIMITS__MAX_UPLOAD_BYTES", "4096")
    monkeypatch.setenv("FACEGATE_ENGINE__MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("FACEGATE_PROFILE", "low-memory")
    s = Settings()
    assert s.limits.max_upload_bytes == 4096 and s.engine.max_batch_size == 8 and s.profile == "low-memory"


@pytest.mark.parametrize("name", ["FACEGATE_ACTIVATION_BUDGET_MIB", "FACEGATE_GC_FREEZE", "FACEGATE_BATCHING"])
def test_internal_tuning_is_not_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "1")
    Settings()  # an unknown variable is ignored: internal tuning comes from facegate.tuning only
    assert name.removeprefix("FACEGATE_").lower() not in Settings.model_fields
