"""benchmarks/server_variants.py: which server names http_e2e.py accepts and the command line each gets."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from facegate.config import Settings
from facegate.tuning import Machine, make_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
sv = pytest.importorskip("server_variants")
http_e2e = pytest.importorskip("http_e2e")

OPTS = SimpleNamespace(device="cuda", precision="fp16", compile="graphs", max_batch_size=None, max_wait_ms=None,
                       mp_workers=4)  # fmt: skip


def argv(name: str) -> list[str]:
    return http_e2e._server_argv(name, 1234, OPTS, Path("/tmp/x"))


@pytest.mark.parametrize("name", ["facegate", "facegate_default", "facegate_mp", "naive", "litserve",
                                  "facegate_mp_w8", "facegate_mp_w8_e3_det64", "facegate_lowmem_irse"])  # fmt: skip
def test_known_names(name: str) -> None:
    assert sv.is_known(name)


@pytest.mark.parametrize("name", ["facegate_mp_w8_e3_det64_nodw", "facegate_mp_wx", "vllm", "facegate_w8"])
def test_unknown_names(name: str) -> None:
    assert not sv.is_known(name)


def test_a_profile_server_is_known_exactly_when_the_settings_have_profiles() -> None:
    has = "profile" in Settings.model_fields
    assert sv.is_known("facegate_profile_auto") is has
    assert sv.profile_of("facegate_profile_low_memory") == "low-memory"
    assert sv.profile_of("facegate_profile_bogus") is None and not sv.is_known("facegate_profile_bogus")
    assert argv("facegate_profile_throughput")[-2:] == ["--profile", "throughput"]


def test_the_tuned_name_adds_up_its_parts() -> None:
    name = "facegate_mp_w8_e3_det64"
    assert sv.front_ends_of(name, mp_workers=4) == 8 and sv.engines_of(name) == 3
    assert sv.server_env(name) == sv.DET64_ENV
    a = argv(name)
    assert a[a.index("--workers") + 1] == "8" and a[a.index("--engines") + 1] == "3"
    assert a[a.index("--engines-per-gpu") + 1] == "3" and a[a.index("--compile") + 1] == "graphs"


def test_the_default_server_gets_no_tuning_flag() -> None:
    a = argv("facegate_default")
    assert a[1:4] == ["-m", "facegate", "serve"]
    assert not {"--device", "--precision", "--compile", "--workers", "--engines"} & set(a)
    assert sv.front_ends_of("facegate_mp", mp_workers=4) == 4 and sv.front_ends_of("facegate", mp_workers=4) == 1


@pytest.mark.parametrize(
    ("name", "budget", "rts"), [("facegate_lowmem", 16, False), ("facegate_lowmem_irse", 24, True)]
)
def test_the_low_memory_servers_keep_their_own_compile_mode(name: str, budget: int, rts: bool) -> None:
    fields = {k.removeprefix("FACEGATE_").lower(): v for k, v in sv.server_env(name).items()}
    s = Settings(device="cuda", **fields)  # every value is one the settings accept
    plan = make_plan(s, Machine(gpus=1, cores=16))
    assert plan.compile == "off" and plan.photo_stage == "off" and plan.activation_budget_mib == budget
    assert (s.rts_checkpoint == Path("/tmp/irse64.pt")) is rts and (s.quality_threshold == 0.0) is rts
    a = argv(name)
    assert "--compile" not in a and "--precision" not in a  # flags would override the profile's own choice
