"""The CPU kernel tier: detected from the CPU's flags, lowered by cpu_isa (never raised above the
CPU's), chosen once at load, and named with every family's kernel on the start-up line."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineConfig, add_engine_args, engine_config_from_args
from pagedllm.kernels import tiers
from tests.kernel_tiers import kernel_tier

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
AMX = AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags, machine, expected", [
    (AMX, "x86_64", "amx"),
    (AMX - {"amx_bf16"}, "x86_64", "avx512"),
    (AVX512 | {"avx512_bf16", "avx512_vnni"}, "x86_64", "avx512"),  # Zen 4
    (AVX512 - {"avx512dq"}, "x86_64", "avx2"),
    (AVX2 | {"avx_vnni"}, "x86_64", "avx2"),
    (AVX2 - {"f16c"}, "x86_64", "portable"),
    (frozenset(), "x86_64", "portable"),
    (AMX, "aarch64", "portable"),  # flags of another architecture never count
])
def test_the_tier_is_the_best_whose_flags_the_cpu_has(flags, machine, expected):
    assert tiers.detect_tier(flags, machine) == expected


@pytest.mark.parametrize("detected", tiers.TIERS)
def test_cpu_isa_lowers_the_tier_and_never_raises_it(detected):
    assert tiers.resolve("auto", detected) == detected
    for tier in tiers.TIERS:
        if tiers.TIERS.index(tier) <= tiers.TIERS.index(detected):
            assert tiers.resolve(tier, detected) == tier
        else:
            with pytest.raises(ValueError, match=f"cpu_isa={tier} is above what this CPU runs") as info:
                tiers.resolve(tier, detected)
            assert "\n" not in str(info.value)


def test_the_setting_refuses_a_tier_above_the_cpu_in_one_line(monkeypatch):
    monkeypatch.setattr(tiers, "detect_tier", lambda *args: "avx2")
    with pytest.raises(ValueError, match="cpu_isa=avx512 is above what this CPU runs"):
        EngineConfig(cpu_isa="avx512")
    with pytest.raises(ValueError, match="cpu_isa must be one of auto, amx, avx512, avx2, portable"):
        EngineConfig(cpu_isa="sse4")
    assert EngineConfig(cpu_isa="avx2").cpu_isa == "avx2"


def test_the_flag_is_derived_from_the_setting():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--cpu-isa", "portable"])).cpu_isa == "portable"
    assert engine_config_from_args(parser.parse_args([])).cpu_isa == "auto"


def test_the_portable_tier_runs_torch_for_every_family():
    with kernel_tier("portable") as choice:
        assert not choice.compiled and tiers.current() is choice
        line = choice.describe()
    assert line.startswith("CPU tier portable (CPU's best: ")
    for family in ("attention torch", "dense matmul torch", "quantized matmul torch",
                   "norms/rotary torch", "sampling torch"):
        assert family in line, line


def test_each_compiled_tier_names_itself_for_every_family(tier):
    line = tiers.current().describe()
    assert line.startswith(f"CPU tier {tier} ")
    for family in ("attention", "dense matmul", "quantized matmul", "norms/rotary", "sampling"):
        assert family in line
    assert "torch" not in line.split("quantized matmul")[1].split(",")[0], line


def test_a_float16_model_is_described_as_running_torch(tier):
    """The compiled layer kernels take float32 and bfloat16 only (and only bfloat16 weights are
    packed): the start-up line of a float16 model says its attention, norms and matmuls run torch
    (SmolLM2, 16 tokens on a busy 2-core AVX-512 CPU without AVX512-FP16: 6.2 s against 0.38 s)."""
    choice = tiers.current()
    line = choice.describe(torch.float16)
    for family in ("attention", "dense matmul", "quantized matmul", "norms/rotary"):
        assert f"{family} torch (no float16 kernel)" in line, line
    assert "in one call" not in line
    for dtype in (None, torch.bfloat16, torch.float32):
        assert "no float16" not in choice.describe(dtype)
    assert choice.describe(torch.bfloat16) == choice.describe()


def test_layers_keep_the_choice_they_were_built_under(tier):
    """A layer reads the tier when it is built, not per call: one built under the portable tier
    runs torch even while a compiled tier is current (and gives the same result)."""
    from pagedllm.model.llama import RMSNorm

    fast = RMSNorm(64, 1e-6)
    with kernel_tier("portable"):
        slow = RMSNorm(64, 1e-6)
    assert fast.fused_ops and not slow.fused_ops
    x = torch.randn(5, 64)
    torch.testing.assert_close(fast(x), slow(x), atol=1e-6, rtol=1e-6)


def test_off_the_cpu_nothing_is_built_or_described(monkeypatch):
    monkeypatch.setattr(tiers, "_choice", [])
    monkeypatch.setattr("pagedllm.kernels.compiled.load", lambda tier: pytest.fail("built"))
    choice = tiers.select("auto", device_type="cuda")
    assert not choice.compiled and choice.describe() == ""
