"""The GPUs the step-time models know: memory, HBM bandwidth, dense tensor-core rates, NVLink and the link to host
memory, each with its source.

Every FLOP/s figure is DENSE: NVIDIA's datasheets print the "with sparsity" (2:4 structured) figure, twice the dense
one, for the tensor-core rows; the numbers here are those halved, or the dense figure where the sheet gives it. A
step of an LLM runs dense GEMMs, so a sparsity figure would make every prefill look twice as fast as it can be.
"""

from __future__ import annotations

from dataclasses import dataclass

_MIB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type as a roofline sees it, with where each number comes from."""

    name: str
    memory_bytes: int  # what the device reports as total (nvidia-smi memory.total), per GPU
    hbm_bytes_per_s: float
    bf16_flops_per_s: float  # dense; fp16 runs at the same rate
    fp8_flops_per_s: float  # dense
    fp4_flops_per_s: float | None  # dense; None: no FP4 tensor cores (Hopper)
    nvlink_bytes_per_s: float  # per direction per GPU (the datasheets print both directions together)
    nvlink_latency_s: float  # per ring step of a collective (alpha of the alpha-beta cost); not a datasheet number
    sources: tuple[str, ...]
    # The GPU's own link to host memory, per direction (the datasheets print both directions together): what a host
    # KV tier's copies of this GPU's shard go over, each GPU of a replica over its own link at once.
    host_link_bytes_per_s: float = 0.0


# PCIe Gen5 x16: the datasheets print "PCIe Gen5: 128 GB/s", both directions: 64 GB/s per direction (32 GT/s x 16
# lanes; 63 GB/s after 128b/130b encoding). Packet headers and flow control take some of it: what a copy reaches is
# dcpserve/simulator/host_tier.py's HOST_LINK_EFFICIENCY of this.
_PCIE_GEN5_X16_BYTES_PER_S = 64e9
# GB200 (not a GpuSpec here: no nvidia-smi size of its GPUs is at hand): the Grace CPU of a Grace Blackwell superchip
# reaches its two Blackwell GPUs over NVLink-C2C, 900 GB/s both directions (NVIDIA's GB200 / NVLink-C2C pages,
# nvidia.com/en-us/data-center/gb200-nvl72 and .../nvlink-c2c). Read here as one 900 GB/s per superchip shared by its
# two GPUs (an assumption: the pages do not split it per GPU): 450 GB/s per direction, 225 GB/s per GPU per direction,
# 3.5x a PCIe Gen5 x16 link. `dcpserve simulate --host-link-gbps 225` models it on a B200.
GB200_C2C_BYTES_PER_S_PER_GPU = 225e9


# NCCL's own cost model (src/graph/tuning.cc, also tuning.h in older releases) puts a ring step over NVLink at
# 0.47 us (hwLat NVLINK, Ring, LL protocol) and each ring collective at a 3.6 us base latency; spread over the 14
# steps of an 8-rank ring all-reduce that is ~0.73 us per step. The same table serves NVLink 4 and 5.
_NVLINK_STEP_LATENCY_S = 0.7e-6
_LATENCY_SOURCE = (
    "nvlink_latency_s 0.7 us per ring step: NCCL's cost model (src/graph/tuning.cc: hwLat NVLink ring LL 0.47 us per "
    "step + baseLat ring LL 3.6 us over the 14 steps of an 8-rank all-reduce); no vendor datasheet gives a latency"
)

H100 = GpuSpec(
    name="H100 SXM 80GB",
    memory_bytes=81559 * _MIB,
    hbm_bytes_per_s=3.35e12,
    bf16_flops_per_s=989.4e12,
    fp8_flops_per_s=1978.9e12,
    fp4_flops_per_s=None,
    nvlink_bytes_per_s=450e9,
    nvlink_latency_s=_NVLINK_STEP_LATENCY_S,
    sources=(
        "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (nvidia.com/en-us/data-center/h100): 80 GB HBM3, "
        "3.35 TB/s, BF16 1,979 TFLOPS and FP8 3,958 TFLOPS 'with sparsity' -> 989.4 / 1,978.9 dense (dense values as "
        "in the NVIDIA H100 Tensor Core GPU Architecture whitepaper), NVLink 900 GB/s (both directions) -> 450 GB/s "
        "per direction; no FP4",
        "memory_bytes 81,559 MiB: nvidia-smi memory.total of an 'NVIDIA H100 80GB HBM3' (public nvidia-smi outputs)",
        _LATENCY_SOURCE,
        "host link: the same datasheet's interconnect row, 'PCIe Gen5: 128GB/s' (both directions, x16) -> 64 GB/s "
        "per direction; in an HGX H100 each GPU has its own x16 link to a PCIe switch and the host CPUs",
    ),
    host_link_bytes_per_s=_PCIE_GEN5_X16_BYTES_PER_S,
)

H200 = GpuSpec(
    name="H200 SXM 141GB",
    memory_bytes=143771 * _MIB,
    hbm_bytes_per_s=4.8e12,
    bf16_flops_per_s=989.4e12,
    fp8_flops_per_s=1978.9e12,
    fp4_flops_per_s=None,
    nvlink_bytes_per_s=450e9,
    nvlink_latency_s=_NVLINK_STEP_LATENCY_S,
    sources=(
        "NVIDIA H200 Tensor Core GPU datasheet / product brief, H200 SXM column (nvidia.com/en-us/data-center/h200): "
        "141 GB HBM3e, 4.8 TB/s, BF16 1,979 and FP8 3,958 TFLOPS 'with sparsity' (the same GH100 tensor cores as "
        "H100) -> 989.4 / 1,978.9 dense, NVLink 900 GB/s (both directions) -> 450 GB/s per direction; no FP4",
        "memory_bytes 143,771 MiB: nvidia-smi memory.total of an 'NVIDIA H200' (public nvidia-smi outputs)",
        _LATENCY_SOURCE,
        "host link: the H200 datasheet's interconnect row, 'PCIe Gen5: 128GB/s' (both directions, x16) -> 64 GB/s "
        "per direction, each GPU of an HGX H200 its own x16 link",
    ),
    host_link_bytes_per_s=_PCIE_GEN5_X16_BYTES_PER_S,
)

B200 = GpuSpec(
    name="B200 180GB",
    memory_bytes=183359 * _MIB,
    hbm_bytes_per_s=8.0e12,
    bf16_flops_per_s=2.25e15,
    fp8_flops_per_s=4.5e15,
    fp4_flops_per_s=9.0e15,
    nvlink_bytes_per_s=900e9,
    nvlink_latency_s=_NVLINK_STEP_LATENCY_S,
    sources=(
        "NVIDIA DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200): 8 B200, 1,440 GB HBM3e total -> 180 GB "
        "each, 64 TB/s total -> 8 TB/s each, FP4 144 PFLOPS and FP8 72 PFLOPS for 8 GPUs 'with sparsity' -> 9 / 4.5 "
        "PFLOPS dense per GPU, 14.4 TB/s NVLink total -> 1.8 TB/s per GPU (5th-generation NVLink, both directions) -> "
        "900 GB/s per direction",
        "NVIDIA HGX B200 per-GPU table (nvidia.com/en-us/data-center/hgx, 1,000 W): FP16/BF16 4.5 PFLOPS with "
        "sparsity -> 2.25 dense; the same table's later revision lists 7.7 TB/s per GPU (62 TB/s total) against the "
        "DGX datasheet's 8 TB/s; 8 TB/s is used here",
        "memory_bytes 183,359 MiB: nvidia-smi memory.total of an 'NVIDIA B200' (public nvidia-smi outputs)",
        _LATENCY_SOURCE,
        "host link: HGX / DGX B200 connect each B200 to the x86 host over PCIe Gen5 x16 (NVIDIA HGX page, "
        "nvidia.com/en-us/data-center/hgx, B200 column: 'PCIe Gen5: 128GB/s'; the DGX B200 datasheet's Xeon "
        "Platinum 8570 hosts are PCIe Gen5) -> 64 GB/s per direction; DGX B200 has 2 TB of system memory, "
        "configurable to 4 TB. GB200's NVLink-C2C: GB200_C2C_BYTES_PER_S_PER_GPU",
    ),
    host_link_bytes_per_s=_PCIE_GEN5_X16_BYTES_PER_S,
)

GPUS: dict[str, GpuSpec] = {"h100": H100, "h200": H200, "b200": B200}


def gpu_spec(name: str) -> GpuSpec:
    """The spec of a GPU by its key ("h100", "h200", "b200"; any case)."""
    spec = GPUS.get(name.lower())
    if spec is None:
        raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)}")
    return spec
