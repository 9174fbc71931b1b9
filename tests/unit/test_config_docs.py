"""docs/configuration.md is what scripts/gen_config_docs.py writes from the Settings class, groups included."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[2]
GEN = runpy.run_path(str(ROOT / "scripts" / "gen_config_docs.py"), run_name="gen_config_docs")


def test_docs_configuration_is_generated_from_the_settings() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_docs.py")], capture_output=True, text=True, check=True
    ).stdout
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert out == doc, "docs/configuration.md is stale: run `python scripts/gen_config_docs.py > docs/configuration.md`"


def test_every_setting_has_a_row_with_its_environment_variable() -> None:
    from facegate.config import Settings

    doc = GEN["render"]()
    for name, field in Settings.model_fields.items():
        assert f"| `{name}` | `FACEGATE_{name.upper()}` |" in doc
        assert field.description, f"{name} has no description"


def test_a_nested_group_gets_its_own_table_with_nested_environment_names() -> None:
    class Limits(BaseModel):
        """What one request may ask for."""

        max_pixels: int = Field(40_000_000, ge=4096, description="Largest accepted image, in pixels.")
        mode: Literal["a", "b"] = Field("a", description="A choice.")

    class Outer(BaseModel):
        model_config = {"env_prefix": "FACEGATE_", "env_nested_delimiter": "__"}
        port: int = Field(7860, ge=1, le=65535, description="Port.")
        limits: Limits = Field(default_factory=Limits, description="Request limits.")

    rows = GEN["table"](Outer, "FACEGATE_", "__")
    assert "| `port` | `FACEGATE_PORT` | int | `7860` | Port. (≥ 1, ≤ 65_535) |" in rows
    assert GEN["group_model"](Outer.model_fields["limits"]) is Limits
    nested = GEN["table"](Limits, "FACEGATE_LIMITS__", "__")
    assert "| `max_pixels` | `FACEGATE_LIMITS__MAX_PIXELS` | int | `40_000_000` |" in nested[2]
    assert "'a' \\| 'b'" in nested[3]
