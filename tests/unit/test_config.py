"""Settings: one config object; every field has a default, a description and, where numeric, bounds."""

from __future__ import annotations

import annotated_types
import pytest
from pydantic import ValidationError

from facegate.config import Settings


def _bounds(field) -> set[str]:
    kinds = set()
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge | annotated_types.Gt):
            kinds.add("lower")
        if isinstance(m, annotated_types.Le | annotated_types.Lt):
            kinds.add("upper")
    return kinds


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_every_field_has_a_default_and_a_description(name: str) -> None:
    field = Settings.model_fields[name]
    assert not field.is_required(), f"{name} has no default"
    assert field.description and len(field.description) > 15, f"{name} has no description"


@pytest.mark.parametrize("name", sorted(n for n, f in Settings.model_fields.items() if f.annotation in (int, float)))
def test_every_numeric_field_is_bounded(name: str) -> None:
    assert _bounds(Settings.model_fields[name]) == {"lower", "upper"}, f"{name} lacks a bound"


def test_a_value_out_of_bounds_is_refused() -> None:
    with pytest.raises(ValidationError):
        Settings(det_nms_threshold=1.5)


def test_det_channels_last_defaults_to_automatic() -> None:
    assert Settings().det_channels_last is None
    assert Settings(det_channels_last=True).det_channels_last is True
