"""The serving plan: one frozen object, derived from the settings and the machine."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

from facegate.config import Settings
from facegate.tuning import Machine, detect_machine, make_plan

H200_HOST = Machine(gpus=1, cores=16)


def test_auto_on_a_16_core_cuda_host_is_the_tuned_gpu_configuration() -> None:
    plan = make_plan(Settings(), H200_HOST)
    assert (plan.profile, plan.device, plan.precision, plan.compile) == ("throughput", "cuda", "fp16", "graphs")
    assert (plan.workers, plan.engines, plan.engines_per_gpu) == (8, 3, 3)
    assert plan.det_max_batch_pixels == 4_194_304 and plan.fused_kernels and plan.det_graphs
    assert plan.photo_stage == "auto" and plan.activation_budget_mib is None


def test_process_counts_follow_cores_and_gpus() -> None:
    assert make_plan(Settings(), Machine(gpus=2, cores=32)).engines == 6
    small = make_plan(Settings(), Machine(gpus=1, cores=4))
    assert (small.workers, small.engines, small.engines_per_gpu) == (2, 1, 1)
    big = make_plan(Settings(), Machine(gpus=8, cores=128))
    assert big.engines <= 16 and big.engines == 8 * big.engines_per_gpu and big.workers <= 64


def test_low_memory_profile() -> None:
    plan = make_plan(Settings(profile="low-memory"), H200_HOST)
    assert (plan.compile, plan.activation_budget_mib, plan.gpu_arena_mib) == ("off", 16.0, 32)
    assert (plan.det_max_batch_pixels, plan.photo_stage, plan.workers, plan.engines) == (65_536, "off", 1, 1)
    irse = make_plan(Settings(profile="low-memory", model="irse64_rts"), H200_HOST)
    assert (irse.activation_budget_mib, irse.gpu_arena_mib) == (24.0, 112)


def test_cpu_plan_without_a_gpu_and_with_profile_cpu() -> None:
    for plan in (make_plan(Settings(), Machine(0, 2)), make_plan(Settings(profile="cpu"), H200_HOST)):
        assert (plan.profile, plan.device, plan.precision, plan.compile, plan.workers) == (
            "cpu", "cpu", "fp32", "torchscript", 1
        )  # fmt: skip
        assert plan.det_channels_last and not plan.fused_kernels and plan.cpu_chunk == 4
    assert make_plan(Settings(), Machine(0, 2)).cpu_shards == 2  # one row of a batch per core at once
    assert make_plan(Settings(compile="off"), Machine(0, 2)).compile == "off"  # the eager recognizer


def test_cpu_plan_runs_bf16_where_the_cpu_has_amx() -> None:
    amx = Machine(0, 2, amx_bf16=True)
    assert (make_plan(Settings(), amx).precision, make_plan(Settings(), amx).compile) == ("bf16", "torchscript")
    assert make_plan(Settings(precision="fp32"), amx).precision == "fp32"  # explicit wins
    assert make_plan(Settings(), Machine(1, 16, amx_bf16=True)).precision == "fp16"  # the GPU's own


def test_explicit_settings_win_over_the_profile() -> None:
    s = Settings(precision="fp32", compile="off", workers=3, engines=2, gpu_preprocess="off")
    plan = make_plan(s, H200_HOST)
    assert (plan.precision, plan.compile, plan.workers, plan.engines, plan.engines_per_gpu) == ("fp32", "off", 3, 2, 2)
    assert plan.photo_stage == "off"
    assert make_plan(Settings(engines=2, workers=1), H200_HOST).workers == 1  # explicit, even if odd
    assert make_plan(Settings(device="cpu", precision="fp16"), H200_HOST).precision == "fp16"  # refused at build


def test_the_plan_is_frozen_and_round_trips() -> None:
    plan = make_plan(Settings(), H200_HOST)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.workers = 1  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(plan)) == plan  # as the engine processes receive it
    line = plan.summary()
    assert "\n" not in line and "profile=throughput" in line and "workers=8" in line


def test_detecting_the_machine_does_not_import_torch() -> None:
    code = "import sys; from facegate.tuning import detect_machine; m = detect_machine(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    m = detect_machine()
    assert m.cores >= 1 and m.gpus >= 0


def test_cuda_visible_devices_bounds_the_gpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    import facegate.tuning as tuning

    monkeypatch.setattr(tuning, "_cuda_build_present", lambda: True)
    monkeypatch.setattr(tuning, "_driver_gpus", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    tuning.detect_machine.cache_clear()
    try:
        assert tuning.detect_machine().gpus == 2
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        tuning.detect_machine.cache_clear()
        assert tuning.detect_machine().gpus == 0
        # CUDA stops at the first invalid entry: a negative id, an index past the driver's GPUs, a repeat
        for visible, gpus in (("0,-1,1", 1), ("-1", 0), ("1,9,2", 1), ("3,3", 1), ("GPU-a1b2,MIG-c3", 2)):
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
            tuning.detect_machine.cache_clear()
            assert tuning.detect_machine().gpus == gpus, visible
    finally:
        tuning.detect_machine.cache_clear()


def test_a_gpu_front_end_admits_a_tenth_of_a_second_of_work_and_a_cpu_one_half_a_second() -> None:
    from facegate.api.limits import Admission

    gpu, cpu = make_plan(Settings(), H200_HOST), make_plan(Settings(), Machine(0, 2))
    assert (gpu.admission_queue_s, cpu.admission_queue_s) == (0.1, 0.5)
    # one process serving HTTP with a GPU engine in it admits half a second, as on the CPU
    assert make_plan(Settings(profile="low-memory"), H200_HOST).admission_queue_s == 0.5
    # the bound is the completion rate times that: 100 completions/s over the 4 completed seconds
    for queue_s, bound in ((gpu.admission_queue_s, 10), (cpu.admission_queue_s, 50)):
        adm = Admission(Settings(), queue_s)
        adm.busy(0.0)
        for i in range(400):
            adm.finished(i / 100)
        assert adm.bound(4.0) == bound
