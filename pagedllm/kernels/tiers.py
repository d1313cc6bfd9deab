"""The CPU kernel layer: the CPU's tier detected once, and the kernel of every family chosen from it
once, at load.

Tiers, best first (each needs the CPU flags of the ones below it too):
- amx: AMX-BF16 tiles (Sapphire Rapids and later): bf16 matmuls, quantized matmuls over many rows
  and bf16 prefill attention on tiles; the rest as avx512.
- avx512: AVX-512 F/BW/VL/DQ with FMA; AVX512-BF16 dot products compiled in where the CPU has them.
- avx2: AVX2 with FMA and F16C (+AVX-VNNI where present): compiled attention, quantized matmuls
  and norms/rotary (plain C++ the compiler vectorizes, AVX2 intrinsics where it is not enough),
  and decode steps in one call; dense matmuls and sampling run portable torch.
- portable: torch alone, on any CPU (and the oracle every compiled kernel is tested against).

`select(cpu_isa)` runs once when an engine loads its model (EngineConfig.cpu_isa; "auto" is the
CPU's best tier): it refuses, in one line, a tier above the CPU's, builds (or finds) the tier's
compiled extension (compiled.py: one per tier, its own -m flags and torch op namespace,
`pagedllm_<tier>`), reads the environment switches once, and records a KernelChoice. Layers read
the choice when they are built (no support checks, builds or environment lookups per call);
kernel wrappers call `current().ops`. A tier whose extension cannot build runs portable, and the
start-up line (`KernelChoice.describe`) names the tier and the kernel of every family.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import threading
from dataclasses import dataclass

from pagedllm import envs
from pagedllm.utils import cpu_flags

logger = logging.getLogger(__name__)

TIERS = ("portable", "avx2", "avx512", "amx")  # lowest first
FAMILIES = ("attention", "dense matmul", "quantized matmul", "norms/rotary", "sampling")
CPU_ISA_CHOICES = ("auto", "amx", "avx512", "avx2", "portable")
# The families a model's layers run through besides torch's dense matmuls: where a tier compiles
# them all (avx2 and up), decode steps run every layer in one call (model/decode_layers.py) and
# batch-invariant mode can run (model/batch_invariant.py).
LAYER_FAMILIES = ("attention", "quantized matmul", "norms/rotary")

# The CPU flags (as /proc/cpuinfo names them) each tier needs on top of the tier below it.
_TIER_FLAGS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "amx": ("amx_tile", "amx_bf16", "avx512_bf16"),
}


def detect_tier(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """The best tier this CPU runs (flags, machine: /proc/cpuinfo's and platform's by default)."""
    flags = cpu_flags() if flags is None else flags
    machine = platform.machine() if machine is None else machine
    if machine not in ("x86_64", "AMD64"):
        return "portable"
    best = "portable"
    for tier in TIERS[1:]:
        if not all(flag in flags for flag in _TIER_FLAGS[tier]):
            break
        best = tier
    return best


def runnable_tiers(detected: str | None = None) -> tuple[str, ...]:
    """The tiers this CPU can run, lowest first: its own and every one below it."""
    detected = detect_tier() if detected is None else detected
    return TIERS[:TIERS.index(detected) + 1]


def resolve(cpu_isa: str, detected: str | None = None) -> str:
    """The tier cpu_isa asks for on this CPU; ValueError (one line) for an unknown name or a tier
    above the CPU's."""
    detected = detect_tier() if detected is None else detected
    if cpu_isa not in CPU_ISA_CHOICES:
        raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISA_CHOICES)}; got {cpu_isa!r}")
    if cpu_isa == "auto":
        return detected
    if TIERS.index(cpu_isa) > TIERS.index(detected):
        raise ValueError(f"cpu_isa={cpu_isa} is above what this CPU runs (its best tier is "
                         f"{detected}: {', '.join(reversed(runnable_tiers(detected)))})")
    return cpu_isa


@dataclass(frozen=True)
class KernelChoice:
    """The kernels every family runs on, chosen once. ops: the tier's compiled torch op namespace
    (None: portable torch for every family). The *_amx fields say where AMX tiles run."""

    tier: str  # the tier the kernels were built for ("portable": none)
    detected: str  # the CPU's best tier
    ops: object | None
    attention_amx: bool = False
    dense_amx: bool = False
    quant_amx: bool = False
    # Decode steps of qualifying models run every layer in one compiled call (model/decode_layers.py).
    decode_layers: bool = False
    why_portable: str | None = None  # why a compiled tier runs portable instead (its build failed)
    device_type: str = "cpu"
    kernel_families: tuple[str, ...] = ()  # the families that run the tier's compiled kernels

    @property
    def compiled(self) -> bool:
        """Whether any family runs a compiled kernel."""
        return self.ops is not None

    def has(self, family: str) -> bool:
        """Whether this family (FAMILIES) runs the tier's compiled kernel."""
        return family in self.kernel_families

    @property
    def runs_layers(self) -> bool:
        """Whether the layers' families (LAYER_FAMILIES) all run compiled kernels."""
        return all(family in self.kernel_families for family in LAYER_FAMILIES)

    @property
    def int8_activations(self) -> bool:
        """Whether the few-rows quantized matmul takes bf16 activations as int8 (docs/cpu-tiers.md:
        the avx2 tier; avx512 where the CPU has VNNI), for the layouts that allow it; a bf16 model's
        quantized weights then take the row-interleaved layout at load (quant_linear.interleave_for_int8)."""
        return "quantized matmul" in self.kernel_families and (
            self.tier == "avx2" or (self.tier == "avx512" and "avx512_vnni" in cpu_flags()))

    @property
    def complete(self) -> bool:
        """Whether every family runs a compiled kernel."""
        return all(family in self.kernel_families for family in FAMILIES)

    def families(self, dtype=None) -> dict[str, str]:
        """The kernel each family runs, by family name (the start-up line's words), for a model in
        dtype (a torch dtype; None: one the compiled kernels take). The compiled layer kernels take
        float32 and bfloat16 (compiled.KERNEL_DTYPES) and only bfloat16 weights are packed for the
        dense matmuls: a float16 model runs torch for all of them, its matmuls unpacked."""
        isa = "avx512" if self.tier == "amx" else self.tier
        kernels = {"attention": f"{isa} + amx prefill" if self.attention_amx else isa,
                   "dense matmul": "amx" if self.dense_amx else "torch (oneDNN)",
                   "quantized matmul": f"{isa} + amx for many rows" if self.quant_amx else isa,
                   "norms/rotary": isa, "sampling": isa}
        portable = {"attention": "torch", "dense matmul": "torch (oneDNN)",
                    "quantized matmul": "torch (int4 kernel in bf16, float32 tiles)", "norms/rotary": "torch",
                    "sampling": "torch"}
        chosen = {family: kernels[family] if self.has(family) else portable[family] for family in portable}
        if not _kernels_take(dtype):
            no_kernel = f"torch (no {str(dtype).removeprefix('torch.')} kernel)"
            chosen.update({family: no_kernel for family in (*LAYER_FAMILIES, "dense matmul")})
        return chosen

    def describe(self, dtype=None) -> str:
        """For the start-up line ("" off the CPU, where these kernels do not run), for a model in
        dtype (as families())."""
        if self.device_type != "cpu":
            return ""
        tier = self.tier if self.why_portable is None else f"portable ({self.tier} did not build)"
        kernels = ", ".join(f"{family} {kernel}" for family, kernel in self.families(dtype).items())
        fused = ("; decode steps run the layers in one call" if self.decode_layers and _kernels_take(dtype)
                 else "")
        return f"CPU tier {tier} (CPU's best: {self.detected}): {kernels}{fused}"


def _kernels_take(dtype) -> bool:
    """Whether the compiled layer kernels take a model in dtype (None: unknown, taken to be so)."""
    from pagedllm.kernels import compiled

    return dtype is None or dtype in compiled.KERNEL_DTYPES


_lock = threading.Lock()
_choice: list[KernelChoice] = []  # the current choice, once made


def select(cpu_isa: str = "auto", device_type: str = "cpu") -> KernelChoice:
    """Choose the kernels (building the tier's extension where it has not been built), make the
    choice current for every layer built after it, and return it. ValueError above the CPU."""
    from pagedllm.kernels import compiled

    detected = detect_tier()
    tier = resolve(cpu_isa, detected)
    if envs.PAGEDLLM_ATTENTION == "torch":
        tier = "portable"
    with _lock:
        # Off the CPU these kernels never run: nothing is built.
        building = tier != "portable" and device_type == "cpu"
        ops, why = compiled.load(tier) if building else (None, None)
        families = compiled.families(tier) if ops is not None else ()
        choice = KernelChoice(tier, detected, ops, why_portable=why, device_type=device_type,
                              kernel_families=families,
                              decode_layers=(envs.PAGEDLLM_DECODE_LAYERS and hasattr(ops, "decode_layers")
                                             and all(f in families for f in LAYER_FAMILIES)))
        if ops is not None and tier == "amx":
            choice = dataclasses.replace(
                choice, attention_amx=envs.PAGEDLLM_ATTENTION_AMX and ops.attention_amx_available(),
                dense_amx=envs.PAGEDLLM_DENSE_AMX and ops.dense_amx_available(),
                quant_amx=ops.quant_amx_available())
        _choice[:] = [choice]
    logger.debug("kernels chosen: %s", choice.describe())
    return choice


def chosen() -> KernelChoice | None:
    """The choice made last, or None where none was made (nothing is built)."""
    return _choice[0] if _choice else None


def current() -> KernelChoice:
    """The choice made last (select("auto") on first use: a model built outside an engine)."""
    if not _choice:
        select()
    return _choice[0]


def available() -> bool:
    """Whether the chosen tier (current(), building it on the first call where it can be) runs
    every family's compiled kernel; a tier with some (avx2) says so per family instead
    (KernelChoice.has), and callers that need all of them take the portable path there."""
    return current().complete


def unavailable_reason() -> str | None:
    """Why the chosen tier runs no compiled kernels (None where it does)."""
    from pagedllm.kernels import compiled

    choice = current()
    if choice.complete:
        return None
    if choice.compiled:
        return f"the {choice.tier} tier compiles only {', '.join(compiled.families(choice.tier))}"
    return choice.why_portable or "the portable tier was chosen (cpu_isa, or PAGEDLLM_ATTENTION=torch)"
