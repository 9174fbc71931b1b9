"""benchmarks/server_variants.py: which server names http_e2e.py accepts and what each changes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from facegate.tuning import Machine, make_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
sv = pytest.importorskip("server_variants")


@pytest.mark.parametrize(
    "name",
    ["facegate", "facegate_lowmem", "naive", "litserve", "facegate_mp_w8", "facegate_mp_w12_e3_det64_hostpre"],
)
def test_known_names(name: str) -> None:
    assert sv.is_known(name)


@pytest.mark.parametrize("name", ["facegate_mp_w8_e3_det64_bogus", "facegate_mp_wx", "vllm", "facegate_w8"])
def test_unknown_names(name: str) -> None:
    assert not sv.is_known(name)


def test_a_composed_name_adds_up_its_parts() -> None:
    name = "facegate_mp_w12_e3_det64_hostpre"
    assert sv.front_ends_of(name, mp_workers=4) == 12
    assert sv.engines_of(name) == 3
    env = sv.server_env(name)
    assert env == {**sv.DET64_ENV, **sv.VARIANT_ENV["hostpre"]}


def test_bases_and_peers() -> None:
    assert sv.front_ends_of("facegate_mp", mp_workers=4) == 4
    assert sv.front_ends_of("facegate", mp_workers=4) == 1
    assert sv.engines_of("facegate_mp_w8") == 1
    assert sv.server_env("facegate_mp_hostpre") == {"FACEGATE_GPU_PREPROCESS": "off"}
    assert sv.server_env("naive") == {}


def test_the_low_memory_server_is_valid_settings_and_keeps_its_own_compile_mode() -> None:
    from types import SimpleNamespace

    from facegate.config import Settings

    env = sv.server_env("facegate_lowmem")
    fields = {k.removeprefix("FACEGATE_").lower(): v for k, v in env.items()}
    s = Settings(device="cuda", **fields)  # every value is one the settings accept
    plan = make_plan(s, Machine(gpus=1, cores=16))
    assert plan.compile == "off" and plan.gpu_arena_mib == 32 and plan.activation_budget_mib == 16
    http_e2e = pytest.importorskip("http_e2e")
    o = SimpleNamespace(device="cuda", precision="fp16", compile="graphs", max_batch_size=64, max_wait_ms=None)
    low = http_e2e._server_argv("facegate_lowmem", 1234, o, Path("/tmp/x"))
    assert "--compile" not in low and "--precision" not in low  # flags would override the profile's choice
    assert "graphs" in http_e2e._server_argv("facegate", 1234, o, Path("/tmp/x"))
    auto = http_e2e._server_argv("facegate_auto", 1234, o, Path("/tmp/x"))
    assert not {"--device", "--precision", "--compile", "--workers", "--engines"} & set(auto)
    nobatch = http_e2e._server_argv("facegate_nobatch", 1234, o, Path("/tmp/x"))
    assert nobatch[nobatch.index("--max-batch-size") + 1] == "1"


@pytest.mark.parametrize(
    ("name", "budget", "rts"), [("facegate_lowmem", 16, False), ("facegate_lowmem_irse", 24, True)]
)
def test_the_low_memory_variants_differ_in_one_thing_each(name: str, budget: int, rts: bool) -> None:
    from facegate.config import Settings

    env = sv.server_env(name)
    fields = {k.removeprefix("FACEGATE_").lower(): v for k, v in env.items()}
    s = Settings(device="cuda", **fields)
    plan = make_plan(s, Machine(gpus=1, cores=16))
    assert sv.is_known(name) and plan.compile == "off" and plan.photo_stage == "off"
    assert plan.activation_budget_mib == budget
    assert (s.rts_checkpoint == Path("/tmp/irse64.pt")) is rts and (s.quality_threshold == 0.0) is rts
