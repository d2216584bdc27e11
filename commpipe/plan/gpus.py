"""GPU table: peak dense bf16 TFLOP/s, memory, HBM and link bandwidths per accelerator.

Every number is a vendor datasheet value (peak, dense, no sparsity); links are per direction.
Achievable fractions of these peaks live in the cost model (`efficiency.Efficiency`,
`cluster.Cluster`), never here.

    >>> resolve_gpu("h100").tflops
    989.0
    >>> resolve_gpu("name=mi300x,tflops=1307,mem_gb=192").mem_gb
    192.0
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    tflops: float        # peak dense bf16 tensor-core TFLOP/s
    mem_gb: float        # HBM capacity in GB as marketed; treated as GiB (2**30 B) of usable memory
    hbm_gbps: float      # HBM bandwidth, decimal GB/s
    nvlink_gbps: float   # NVLink bandwidth per GPU per direction, decimal GB/s
    nic_gbps: float      # default scale-out bandwidth per GPU (one NIC per GPU), decimal GB/s
    fp8_tflops: float = 0.0   # peak dense FP8 tensor-core TFLOP/s; 0: no FP8 tensor cores
    mamf: float = 1.0         # maximum achievable matmul FLOP/s / bf16 peak (measured, see below)
    mamf_fp8: float = 1.0     # the same for FP8 GEMMs
    sms: int = 0              # streaming multiprocessors (datasheet); 0: unknown (TE userbuffers'
    #                           SM margin, kernels.ub_gemm_times, is then not priced)

    @property
    def ridge_flop_per_byte(self) -> float:
        """Roofline ridge point of the achievable matmul rate: arithmetic intensity at which a
        GEMM stops being HBM-bound."""
        return self.achievable_tflops("bf16") * 1e12 / (self.hbm_gbps * 1e9)

    def achievable_tflops(self, precision: str) -> float:
        """The fastest any GEMM of `precision` runs on this GPU (the datasheet peak times the
        measured MAMF fraction): the ceiling the cost model's efficiency curve scales."""
        if precision == "fp8":
            return self.peak_tflops("fp8") * self.mamf_fp8
        return self.tflops * self.mamf

    def peak_tflops(self, precision: str) -> float:
        """Dense tensor-core peak for the GEMMs of `precision` (fp8: the FP8 peak)."""
        if precision == "fp8":
            if self.fp8_tflops <= 0:
                raise ValueError(f"GPU {self.name} has no FP8 tensor cores; use --precision bf16, or "
                                 "give fp8_tflops=.. in a custom --gpu entry")
            return self.fp8_tflops
        return self.tflops

    def to_dict(self) -> dict:
        return asdict(self)


# Sources (peak dense bf16 = half the "with sparsity" figure of the datasheets):
# - A100: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TFLOPS, 40GB HBM2 1,555 GB/s,
#   80GB HBM2e 2,039 GB/s, NVLink 3 600 GB/s bidirectional. NIC: DGX A100 user guide, eight
#   ConnectX-6 200 Gb/s HDR InfiniBand ports for compute = 25 GB/s per GPU.
# - H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity (989 dense),
#   80GB HBM3 3.35 TB/s, NVLink 4 900 GB/s. NIC: DGX H100 datasheet, eight ConnectX-7 400 Gb/s
#   (NDR) = 50 GB/s per GPU.
# - H200 SXM: NVIDIA H200 datasheet: same compute as H100 (989 dense), 141GB HBM3e 4.8 TB/s,
#   NVLink 900 GB/s; HGX H200 ships with 400 Gb/s NICs per GPU.
# - B200: NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training for 8 GPUs = 9 PF FP8 sparse per GPU,
#   i.e. 4.5 PF FP8 dense and 2.25 PF bf16 dense; HGX B200 192GB HBM3e 8 TB/s; NVLink 5 1.8 TB/s
#   bidirectional; eight ConnectX-7 400 Gb/s.
# FP8 (dense = half the sparse figure): H100 SXM and H200 datasheets 3,958 TFLOPS FP8 with sparsity
# -> 1979; B200: 72 PF FP8 per 8-GPU DGX B200 with sparsity -> 4500 dense. A100 has no FP8.
# MAMF (maximum achievable matmul FLOP/s, a microbenchmark: the best of a scan of large GEMM
# shapes, torch.matmul / torch._scaled_mm) over the datasheet peak, from the table
# "Maximum Achievable Matmul FLOPS comparison table" of github.com/stas00/ml-engineering
# compute/accelerator/README.md: bf16 A100 SXM 271.2/312 (0.869), H100 SXM 794.5/989 (0.803,
# "H200 is the same"), B200 1745.0/2250 (0.776); FP8 H100 SXM 1402.6/1979 (0.709), H200 SXM
# 1453.4/1979 (0.734), B200 3432.5/4500 (0.763). The peaks assume boost clocks that a GPU under
# sustained tensor-core load cannot hold within its power limit, so the fraction differs by GPU
# (and by precision): it is a property of the hardware, not of the training framework, and the
# cost model's efficiencies are relative to it. A100 40GB and PCIe variants: the SXM figure.
GPUS: dict[str, GPU] = {
    "a100-40gb": GPU("a100-40gb", 312.0, 40.0, 1555.0, 300.0, 25.0, 0.0, 0.869, sms=108),
    "a100-80gb": GPU("a100-80gb", 312.0, 80.0, 2039.0, 300.0, 25.0, 0.0, 0.869, sms=108),
    "h100": GPU("h100", 989.0, 80.0, 3350.0, 450.0, 50.0, 1979.0, 0.803, 0.709, sms=132),
    "h200": GPU("h200", 989.0, 141.0, 4800.0, 450.0, 50.0, 1979.0, 0.803, 0.734, sms=132),
    "b200": GPU("b200", 2250.0, 192.0, 8000.0, 900.0, 50.0, 4500.0, 0.776, 0.763, sms=148),
}
ALIASES = {"a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb",
           "h100-sxm": "h100", "h100-80gb": "h100", "h200-141gb": "h200", "b200-192gb": "b200"}

# Defaults for a custom entry that does not give them: A100-class memory system and links.
# A custom entry without mamf= takes its tflops as reachable (mamf 1): give mamf=MAMF/peak with a
# datasheet peak.
_CUSTOM_DEFAULTS = {"hbm_gbps": 2000.0, "nvlink_gbps": 300.0, "nic_gbps": 25.0, "fp8_tflops": 0.0,
                    "mamf": 1.0, "mamf_fp8": 1.0, "sms": 0}
_CUSTOM_KEYS = ("name", "tflops", "mem_gb", "hbm_gbps", "nvlink_gbps", "nic_gbps", "fp8_tflops", "mamf",
                "mamf_fp8", "sms")


def resolve_gpu(text: str) -> GPU:
    """A table name (`h100`, `a100-80gb`, ...), `cpu` (this machine, measured by
    `commpipe.plan.cpu`), a custom entry
    `name=foo,tflops=..,mem_gb=..[,hbm_gbps=..,nvlink_gbps=..,nic_gbps=..,fp8_tflops=..,mamf=..,
    mamf_fp8=..,sms=..]`, or a
    table entry with fields changed: `h100,mem_gb=96,hbm_gbps=2400` (a variant)."""
    head = text.split(",", 1)[0]
    if "=" in text and "=" not in head:
        base = resolve_gpu(head)
        rest = text.split(",", 1)[1]
        variant = resolve_gpu(",".join(f"{k}={v}" for k, v in base.to_dict().items()) + "," + rest)
        return variant if "name=" in rest else _renamed(variant, f"{base.name}-variant")
    if "=" not in text:
        key = ALIASES.get(text.lower(), text.lower())
        if key == "cpu":
            from commpipe.plan.cpu import this_cpu

            return this_cpu()
        if key not in GPUS:
            raise ValueError(f"unknown GPU {text!r}; use one of {', '.join(GPUS)}, cpu, or a custom "
                             "entry like name=foo,tflops=500,mem_gb=96")
        return GPUS[key]
    values: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ValueError(f"malformed GPU field {part!r}: write key=value, e.g. tflops=500")
        k, v = (s.strip() for s in part.split("=", 1))
        if k not in _CUSTOM_KEYS:
            raise ValueError(f"unknown GPU field {k!r}; known fields: {', '.join(_CUSTOM_KEYS)}")
        values[k] = v
    missing = [k for k in ("tflops", "mem_gb") if k not in values]
    if missing:
        raise ValueError(f"custom GPU {text!r} is missing {', '.join(missing)}; "
                         "give at least name=..,tflops=..,mem_gb=..")
    nums: dict[str, float] = {}
    for k in _CUSTOM_KEYS[1:]:
        raw = values.get(k, _CUSTOM_DEFAULTS.get(k))
        try:
            nums[k] = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"GPU field {k}={raw!r} is not a number") from None
        if nums[k] < 0 or (nums[k] == 0 and k not in ("fp8_tflops", "sms")):
            raise ValueError(f"GPU field {k}={raw} must be positive")
        if k.startswith("mamf") and nums[k] > 1:
            raise ValueError(f"GPU field {k}={raw} is a fraction of the peak: give a value in (0, 1]")
    nums["sms"] = int(nums["sms"])
    return GPU(values.get("name", "custom"), **nums)


def _renamed(gpu: GPU, name: str) -> GPU:
    from dataclasses import replace

    return replace(gpu, name=name)
