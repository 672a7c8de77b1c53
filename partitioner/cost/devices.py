"""Device and cluster descriptions: peak speed, memory bandwidth, capacity, and the links between stages.

A device's memory is its capacity (80 GiB for an H100-80GB); the planner fits stages in
``DeviceSpec.usable_memory``, that less ``DeviceSpec.memory_reserve``: what the CUDA context, the
caching allocator's fragmentation and NCCL's buffers take on a GPU (``GPU_MEMORY_RESERVE``), the
interpreter and the operating system on a host (``HOST_MEMORY_RESERVE``). Presets carry their
kind's reserve; ``Cluster.with_memory_reserve`` sets another (``pipecut plan --memory-reserve``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.errors import ClusterError, ClusterFormatError, UnknownDeviceError

if TYPE_CHECKING:
    from partitioner.cost.calibrate import Calibration
    from partitioner.cost.probes import Probe

__all__ = [
    "DeviceSpec", "Cluster", "DEVICE_PRESETS", "ReserveRule", "GPU_MEMORY_RESERVE", "HOST_MEMORY_RESERVE",
    "parse_reserve", "reserve_bytes", "default_device",
]

log = logging.getLogger(__name__)

_GB = 1e9
_GIB = 2**30


@dataclass(frozen=True)
class ReserveRule:
    """How much of a device's memory the planner leaves free: ``fixed + fraction x capacity`` bytes
    (at most the capacity).

    Example:
        >>> rule = ReserveRule(fixed=2 * 2**30, fraction=0.05)
        >>> rule.of(80 * 2**30) / 2**30, rule.of(24 * 2**30) / 2**30
        (6.0, 3.2)
    """

    fixed: float
    """Bytes every device loses whatever its size (a CUDA context, NCCL's buffers, a process's libraries)."""
    fraction: float
    """The share of the capacity lost on top of that, for what grows with the memory in use (fragmentation)."""

    def of(self, memory: float) -> float:
        """The reserve of a device of ``memory`` bytes (none when its memory is unlimited)."""
        if not math.isfinite(memory):
            return 0.0
        return min(memory, self.fixed + self.fraction * memory)


GPU_MEMORY_RESERVE = ReserveRule(fixed=2 * _GIB, fraction=0.05)
"""The memory a GPU preset keeps out of the plan: ``2 GiB + 5 %`` of the card (6 GiB of an
H100-80GB or A100-80GB, 9.05 of an H200-141GB, 3.2 of an L4-24GB). Measured on one H100 80GB
(``benchmarks/cuda_reserve.py``; docs/partitioning.md, *Device memory and the reserve*): fixed,
the card's ``total_memory`` short of its name (0.82 GiB), the CUDA context with cuBLAS (0.58 GiB)
and a one-rank NCCL communicator (0.64 GiB; a job has several, with buffers per peer); growing
with use, the caching allocator's reserved-but-unallocated bytes at the peak (about 5 %).
Without it a plan at 99 % of the card is chosen and fails with out-of-memory;
``Cluster.with_memory_reserve`` or ``--memory-reserve`` override it per run.
"""

HOST_MEMORY_RESERVE = ReserveRule(fixed=0.5 * _GIB, fraction=0.10)
"""The memory a CPU device (the ``cpu`` preset, a ``Cluster.measure`` process) keeps out of the
plan: ``0.5 GiB + 10 %``. Each process loads the interpreter and torch's libraries (about 0.3 to
0.5 GiB resident before a tensor), the allocator (glibc malloc) keeps freed pages, and the
operating system and page cache live in the same memory."""
CLUSTER_FORMAT = "pipecut.cluster"
CLUSTER_VERSION = 1


@dataclass(frozen=True)
class DeviceSpec:
    """What the cost model needs to know about one accelerator.

    Args:
        name: a label shown in plans.
        peak_flops: dense 16-bit (bf16/fp16) peak FLOP/s.
        peak_flops_fp32: dense fp32 peak FLOP/s (TF32 disabled).
        mem_bandwidth: device memory bandwidth, bytes/s.
        memory: usable memory capacity, bytes.
        link_bandwidth: default bandwidth of the link to the next device, bytes/s.
        link_latency: default latency of one transfer over that link, seconds.
        op_overhead: fixed cost per operator launch, seconds.
        node_size: devices in one node of a typical machine of this part (they talk over
            ``link_bandwidth``); ``0``: one node holds any number (a single host).
        inter_node_bandwidth: bytes/s per device between nodes (its share of the node's network).
        inter_node_latency: seconds per transfer between nodes.
        action_overhead: seconds the pipeline runtime spends per action (a stage's forward,
            backward, input- or weight-gradient of one micro-batch) beyond the ops it runs:
            scheduling, stashing, posting sends and waiting to be woken. Negligible beside GPU
            kernels (0 in the presets); on shared CPU cores it is measured
            (``runtime.overheads.measure_action_overhead``).
        memory_reserve: bytes of ``memory`` the plan leaves free (see the module docstring):
            the presets' is ``GPU_MEMORY_RESERVE`` or ``HOST_MEMORY_RESERVE``; a device described
            by hand has none unless given.

    Raises:
        ClusterError: a negative reserve, or one larger than the memory.

    Example:
        >>> h100 = DeviceSpec.preset("H100-80GB")
        >>> h100.memory / 2**30, h100.memory_reserve / 2**30, h100.usable_memory / 2**30
        (80.0, 6.0, 74.0)
    """

    name: str
    peak_flops: float
    peak_flops_fp32: float
    mem_bandwidth: float
    memory: float
    link_bandwidth: float = 100 * _GB
    link_latency: float = 10e-6
    op_overhead: float = 4e-6
    node_size: int = 0
    inter_node_bandwidth: float = 25 * _GB
    inter_node_latency: float = 5e-6
    action_overhead: float = 0.0
    memory_reserve: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.memory_reserve <= self.memory:
            raise ClusterError(
                f"device {self.name!r}: memory_reserve {self.memory_reserve / _GIB:.3g} GiB must be at least 0 and "
                f"at most its memory ({self.memory / _GIB:.3g} GiB): give a smaller reserve (a preset's is kept by "
                "replace(preset, memory=...): pass memory_reserve=... with it, 0 for none)"
            )

    @property
    def usable_memory(self) -> float:
        """Bytes the plan may fill: ``memory`` less ``memory_reserve``."""
        return self.memory - self.memory_reserve

    @staticmethod
    def preset(name: str) -> DeviceSpec:
        """Return a copy of a named preset (see ``DEVICE_PRESETS``); names are case-insensitive."""
        for key, spec in DEVICE_PRESETS.items():
            if key.lower() == name.lower():
                return spec
        raise UnknownDeviceError(
            f"unknown device preset {name!r}; known presets: {', '.join(DEVICE_PRESETS)}. "
            "Or describe the device yourself: DeviceSpec(name=..., peak_flops=..., "
            "peak_flops_fp32=..., mem_bandwidth=..., memory=...)"
        )

    def flops_for(self, dtype_name: str) -> float:
        """Peak FLOP/s for arithmetic in ``dtype_name`` (e.g. 'torch.float32')."""
        if "float32" in dtype_name or "float64" in dtype_name:
            return self.peak_flops_fp32
        return self.peak_flops


def _cpu_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a small machine
        return 16.0 * _GIB


# Vendor datasheet figures (dense, no sparsity). Link bandwidth is per direction between
# neighbouring devices of one node (NVLink for SXM parts); latency is a typical P2P send. Nodes
# are the vendor's 8-GPU boxes (DGX/HGX), one InfiniBand port per GPU between nodes: HDR
# (200 Gb/s, 25 GB/s) for V100/A100, NDR (400 Gb/s, 50 GB/s) for H100/H200; L4 servers over
# 100 Gb/s Ethernet shared by 8.
def _gpu(name: str, flops: float, fp32: float, bandwidth: float, memory: float, link: float, latency: float,
         inter_node: float) -> DeviceSpec:
    return DeviceSpec(name, flops, fp32, bandwidth, memory, link, latency, node_size=8,
                      inter_node_bandwidth=inter_node, memory_reserve=GPU_MEMORY_RESERVE.of(memory))


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "V100-32GB": _gpu("V100-32GB", 125e12, 15.7e12, 900 * _GB, 32 * _GIB, 150 * _GB, 10e-6, 12.5 * _GB),
    "A100-40GB": _gpu("A100-40GB", 312e12, 19.5e12, 1555 * _GB, 40 * _GIB, 300 * _GB, 10e-6, 25 * _GB),
    "A100-80GB": _gpu("A100-80GB", 312e12, 19.5e12, 2039 * _GB, 80 * _GIB, 300 * _GB, 10e-6, 25 * _GB),
    "H100-80GB": _gpu("H100-80GB", 989e12, 67e12, 3350 * _GB, 80 * _GIB, 450 * _GB, 8e-6, 50 * _GB),
    "H200-141GB": _gpu("H200-141GB", 989e12, 67e12, 4800 * _GB, 141 * _GIB, 450 * _GB, 8e-6, 50 * _GB),
    "L4-24GB": _gpu("L4-24GB", 121e12, 30.3e12, 300 * _GB, 24 * _GIB, 32 * _GB, 15e-6, 1.5 * _GB),
    # One CPU core running fp32 matmuls; gloo over loopback between processes.
    "cpu": DeviceSpec("cpu", 50e9, 50e9, 10 * _GB, _cpu_memory(), 2 * _GB, 50e-6, 2e-6,
                      memory_reserve=HOST_MEMORY_RESERVE.of(_cpu_memory())),
}

# The words of ``torch.cuda.get_device_name`` that name each GPU preset's part (the A100s by memory).
_GPU_PARTS = (("H200", "H200-141GB"), ("H100", "H100-80GB"), ("A100", "A100"), ("V100", "V100-32GB"),
              ("L4", "L4-24GB"))

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1.0, **{f"{p}b": 1e3 ** (i + 1) for i, p in enumerate("kmgt")},
          **{f"{p}ib": 2.0 ** (10 * (i + 1)) for i, p in enumerate("kmgt")}}


def parse_reserve(text: str) -> tuple[float, bool]:
    """``(bytes, False)`` for a size (``'2GiB'``, ``'512MiB'``, ``'1.5GB'``, ``'0'``), ``(fraction, True)``
    for a share of the memory (``'10%'``).

    Raises:
        ClusterError: neither, naming the forms it takes.

    Example:
        >>> parse_reserve("1.5GiB"), parse_reserve("10%")
        ((1610612736.0, False), (0.1, True))
    """
    value = text.strip()
    if value.endswith("%"):
        try:
            share = float(value[:-1])
        except ValueError:
            share = -1.0
        if not 0 <= share < 100:
            raise ClusterError(f"memory reserve {text!r}: a share of the memory is 0% to 99%, e.g. '10%'")
        return share / 100, True
    found = _SIZE.match(value)
    if not found or (found.group(2) is None and float(found.group(1)) != 0):
        raise ClusterError(
            f"memory reserve {text!r} is not a size: give it with its unit ('2GiB', '512MiB', '1.5GB'), "
            "as a share of each device's memory ('10%'), or '0' for none"
        )
    return float(found.group(1)) * _UNITS[(found.group(2) or "b").lower()], False


def reserve_bytes(reserve: float | str, memory: float) -> float:
    """A memory reserve as bytes of a device of ``memory`` bytes.

    ``reserve`` is bytes (a number), or text: a size with its unit (``'2GiB'``, ``'512MiB'``,
    ``'1.5GB'``; ``'0'`` for none) or a share of the device's memory (``'10%'``).

    Raises:
        ClusterError: text that is neither, or a reserve not less than ``memory``.

    Example:
        >>> reserve_bytes("2GiB", 80 * 2**30) / 2**30, reserve_bytes("10%", 80 * 2**30) / 2**30
        (2.0, 8.0)
    """
    if isinstance(reserve, str):
        amount, share = parse_reserve(reserve)
        value = amount * memory if share else amount
    else:
        value = float(reserve)
    if not 0 <= value < memory:
        raise ClusterError(
            f"memory reserve {reserve!r} ({value / _GIB:.3g} GiB) leaves nothing of a device's "
            f"{memory / _GIB:.3g} GiB: give a smaller reserve"
        )
    return value


def default_device() -> str:
    """This machine's device preset, what ``pipecut plan`` and ``pipecut train`` cost for unless told.

    The first CUDA GPU's preset, matched by the words of its name (``'NVIDIA H100 80GB HBM3'`` is
    ``'H100-80GB'``; an A100 by its memory); ``'cpu'`` with no GPU, or with one no preset
    describes (a warning names it: pass ``--device`` or describe it with ``DeviceSpec``).

    Example:
        >>> default_device() in DEVICE_PRESETS
        True
    """
    import torch  # only here: the device descriptions need no torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    words = re.split(r"[^A-Z0-9]+", name.upper())  # 'NVIDIA A100-SXM4-80GB': NVIDIA, A100, SXM4, 80GB
    for word, preset in _GPU_PARTS:
        if word in words:
            if preset == "A100":
                big = torch.cuda.get_device_properties(0).total_memory > 60 * _GIB
                return "A100-80GB" if big else "A100-40GB"
            return preset
    log.warning("no device preset describes this machine's GPU %r: planning for 'cpu'; pass --device "
                "(one of %s) or describe it with DeviceSpec", name, ", ".join(DEVICE_PRESETS))
    return "cpu"


@dataclass(frozen=True)
class Cluster:
    """The devices the stages run on, in pipeline order, and the links between neighbours.

    ``devices[s]`` runs stage ``s``; ``link_bandwidth[s]`` and ``link_latency[s]`` describe the
    link from stage ``s`` to stage ``s + 1`` (so both have ``len(devices) - 1`` entries).

    The layout search (``partitioner.plan.layout``) also reads how the devices talk as a group:
    ``collective_bandwidth`` and ``collective_latency``, when set (measured by
    ``partitioner.cost.calibrate``), price every data-parallel collective; otherwise a
    collective runs at the link bandwidth inside a node of ``devices[0].node_size`` and at
    ``devices[0].inter_node_bandwidth`` once its group spans nodes.

    Example:
        >>> c = Cluster.uniform(4, "H100-80GB")
        >>> len(c), c.devices[0].name, len(c.link_bandwidth)
        (4, 'H100-80GB', 3)
    """

    devices: tuple[DeviceSpec, ...]
    link_bandwidth: tuple[float, ...] = field(default=())
    link_latency: tuple[float, ...] = field(default=())
    collective_bandwidth: float | None = None
    """Bus bandwidth of an all-reduce (bytes/s per device, as ``nccl-tests`` reports it), measured."""
    collective_latency: float | None = None
    """Seconds a collective takes per step of its ring (``2 (n - 1)`` steps for an all-reduce), measured."""
    cores: int | None = None
    """The CPU cores the devices share, when they are processes of one host measured busy all at once
    (``Cluster.measure``): the layout search then lets the busy ones run faster while others idle."""
    calibrated: str | None = field(default=None, compare=False)
    """Where the devices' figures were measured (``'this host'`` from ``Cluster.measure``, the file a
    ``Cluster.load`` read); ``None``: a description's own figures (a preset's datasheet), priced by
    the roofline. :attr:`estimate_basis` says which in a plan. Not compared: a cluster read back
    from its file is the same cluster."""

    def __post_init__(self) -> None:
        if not self.devices:
            raise ClusterError("a Cluster needs at least one device")
        n_links = len(self.devices) - 1
        if not self.link_bandwidth:
            object.__setattr__(
                self, "link_bandwidth", tuple(d.link_bandwidth for d in self.devices[:-1])
            )
        if not self.link_latency:
            object.__setattr__(
                self, "link_latency", tuple(d.link_latency for d in self.devices[:-1])
            )
        for label, seq in (("link_bandwidth", self.link_bandwidth), ("link_latency", self.link_latency)):
            if len(seq) != n_links:
                raise ClusterError(
                    f"{label} has {len(seq)} entries but a cluster of {len(self.devices)} devices "
                    f"has {n_links} links (one between each pair of neighbouring stages)"
                )
        if any(b <= 0 for b in self.link_bandwidth):
            raise ClusterError(f"link bandwidths must be positive, got {self.link_bandwidth}")
        if self.collective_bandwidth is not None and self.collective_bandwidth <= 0:
            raise ClusterError(f"collective_bandwidth must be positive, got {self.collective_bandwidth}")

    def __len__(self) -> int:
        return len(self.devices)

    @staticmethod
    def uniform(
        num_devices: int,
        device: str | DeviceSpec = "A100-80GB",
        *,
        link_bandwidth: float | None = None,
        link_latency: float | None = None,
        memory_reserve: float | str | None = None,
    ) -> Cluster:
        """``num_devices`` identical devices in a chain with identical links.

        Args:
            num_devices: how many devices (one stage each).
            device: a preset name (see ``DEVICE_PRESETS``) or a ``DeviceSpec``.
            link_bandwidth: bytes/s between neighbours; defaults to the device's preset link.
            link_latency: seconds per transfer; defaults to the device's preset latency.
            memory_reserve: each device's memory the plan leaves free, as :func:`reserve_bytes`
                reads it (``'2GiB'``, ``'10%'``, bytes); default the device's own.

        Example:
            >>> c = Cluster.uniform(2, "H100-80GB", memory_reserve="10%")
            >>> c.devices[0].memory_reserve / 2**30, c.devices[0].usable_memory / 2**30
            (8.0, 72.0)
        """
        if num_devices < 1:
            raise ClusterError(f"num_devices must be at least 1, got {num_devices}")
        spec = DeviceSpec.preset(device) if isinstance(device, str) else device
        if memory_reserve is not None:
            spec = replace(spec, memory_reserve=reserve_bytes(memory_reserve, spec.memory))
        bw = spec.link_bandwidth if link_bandwidth is None else link_bandwidth
        lat = spec.link_latency if link_latency is None else link_latency
        return Cluster(
            devices=(spec,) * num_devices,
            link_bandwidth=(bw,) * (num_devices - 1),
            link_latency=(lat,) * (num_devices - 1),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (:meth:`from_dict` reads it back); the measured collective fields
        only when set, so files written before they existed keep their bytes."""
        data: dict[str, Any] = {
            "devices": [asdict(d) for d in self.devices],
            "link_bandwidth": list(self.link_bandwidth),
            "link_latency": list(self.link_latency),
        }
        for key in ("collective_bandwidth", "collective_latency", "cores", "calibrated"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        return data

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Cluster:
        """The cluster :meth:`to_dict` wrote.

        Example:
            >>> c = Cluster.uniform(2, "cpu", link_bandwidth=1e9)
            >>> Cluster.from_dict(c.to_dict()) == c
            True
        """
        return Cluster(
            devices=tuple(DeviceSpec(**d) for d in data["devices"]),
            link_bandwidth=tuple(float(x) for x in data["link_bandwidth"]),
            link_latency=tuple(float(x) for x in data["link_latency"]),
            collective_bandwidth=_opt_float(data.get("collective_bandwidth")),
            collective_latency=_opt_float(data.get("collective_latency")),
            cores=None if data.get("cores") is None else int(data["cores"]),
            calibrated=None if data.get("calibrated") is None else str(data["calibrated"]),
        )

    @staticmethod
    def measure(
        devices: int = 1,
        *,
        backend: str = "gloo",
        processes: int | None = None,
        probe: Probe | None = None,
        timeout: float = 120.0,
    ) -> Cluster:
        """``devices`` identical devices as this host's processes really run them, measured.

        Spawns ``max(devices, processes)`` one-thread processes joined by ``backend``; the first
        ``processes`` time matrix products (``probe.gemms``: pass ``Probe().with_gemms(
        gemms.model_gemms(traced))`` for the model's own sizes), memory bandwidth and per-op overhead
        all at once, so cores they share show as the speed each gets; then the p2p link and the
        all-reduce are timed between them. See ``partitioner.cost.calibrate`` for the method;
        ``calibrate.measure`` returns the raw numbers too. Takes a few seconds per probe size.

        Args:
            devices: pipeline devices (processes that talk), one stage or replica rank each.
            backend: torch.distributed backend; ``"gloo"`` (CPU processes).
            processes: processes computing at once (default ``devices``).
            probe: what to time (default ``Probe()``; ``Probe.tiny()`` for a rough look in a second).
            timeout: seconds for the whole measurement; processes past it are killed.

        Raises:
            CalibrationError: a measuring process failed or ran past ``timeout``.

        Example:
            >>> from partitioner.cost.probes import Probe
            >>> c = Cluster.measure(2, probe=Probe.tiny())  # doctest: +SKIP
            >>> c.devices[0].name, c.collective_bandwidth > 0  # doctest: +SKIP
            ('cpu (measured)', True)
        """
        from partitioner.cost import calibrate  # torch and processes only when measuring

        cal = calibrate.measure(devices, backend=backend, processes=processes, probe=probe, timeout=timeout)
        return Cluster.from_calibration(cal)

    @staticmethod
    def from_calibration(cal: Calibration) -> Cluster:
        """``cal.devices`` identical devices as ``cal`` measured them, with its links and all-reduce.

        The device, ``"cpu (measured)"``, has one rank's GEMM FLOP/s (bf16 as ``peak_flops``, fp32
        as ``peak_flops_fp32``; a dtype not measured takes the other's), memory bandwidth and
        per-op overhead, the host's memory shared by ``cal.processes``, and the measured p2p link
        (the preset ``"cpu"`` link when one device measured none).
        """
        cpu = DEVICE_PRESETS["cpu"]
        flops = dict(cal.compute.flops)
        fp32 = flops.get("float32", flops.get("bfloat16", cpu.peak_flops_fp32))
        spec = DeviceSpec(
            name="cpu (measured)",
            peak_flops=flops.get("bfloat16", fp32),
            peak_flops_fp32=fp32,
            mem_bandwidth=cal.compute.memory.bandwidth,
            memory=cpu.memory / cal.processes,
            link_bandwidth=cal.p2p.bandwidth if cal.p2p else cpu.link_bandwidth,
            link_latency=cal.p2p.latency if cal.p2p else cpu.link_latency,
            op_overhead=cal.compute.op_overhead,
            memory_reserve=HOST_MEMORY_RESERVE.of(cpu.memory / cal.processes),
        )
        base = replace(Cluster.uniform(cal.devices, spec), calibrated=f"this host ({cal.processes} processes)")
        if cal.allreduce is None:
            return base
        return replace(base, collective_bandwidth=cal.allreduce.bandwidth, collective_latency=cal.allreduce.latency)

    def save(self, path: str | os.PathLike[str], *, details: Mapping[str, Any] | None = None) -> Path:
        """Write this cluster as JSON (a format tag and version, the cluster, and ``details``, e.g.
        a calibration's raw numbers, which :meth:`load` ignores); returns the path.

        Example:
            >>> import tempfile
            >>> path = Cluster.uniform(2, "cpu").save(tempfile.mkdtemp() + "/cluster.json")
            >>> Cluster.load(path) == Cluster.uniform(2, "cpu")
            True
        """
        out = Path(path)
        doc = {"format": CLUSTER_FORMAT, "version": CLUSTER_VERSION, "cluster": self.to_dict(),
               "details": dict(details or {})}
        out.write_text(json.dumps(doc, indent=1) + "\n")
        return out

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Cluster:
        """The cluster :meth:`save` (or ``pipecut calibrate --out``) wrote.

        Raises:
            FileNotFoundError: no file at ``path``.
            ClusterFormatError: not JSON, not a cluster file, a newer format version, or fields a
                ``Cluster``/``DeviceSpec`` does not take (the message names the file and field).
        """
        text = Path(path).read_text()
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ClusterFormatError(
                f"{path} is not JSON ({e}); write it with Cluster.save or `pipecut calibrate --out {path}`"
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != CLUSTER_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ClusterFormatError(
                f"{path} is not a cluster file (format {found!r}, expected {CLUSTER_FORMAT!r}); "
                f"write it with Cluster.save or `pipecut calibrate --out {path}`"
            )
        version = doc.get("version")
        if not isinstance(version, int) or not 1 <= version <= CLUSTER_VERSION:
            raise ClusterFormatError(
                f"{path} has cluster format version {version!r}; this pipecut reads versions 1 to "
                f"{CLUSTER_VERSION}: upgrade pipecut, or measure again with `pipecut calibrate --out {path}`"
            )
        try:
            cluster = Cluster.from_dict(doc["cluster"])
        except ClusterError as e:
            raise ClusterFormatError(f"{path}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ClusterFormatError(
                f"{path} holds a cluster that cannot be read ({type(e).__name__}: {e}); measure it again "
                f"with `pipecut calibrate --out {path}`"
            ) from None
        # A measured cluster says where it was measured: this file (the host it was measured on may be
        # gone). Files written before ``calibrated`` existed say so by their devices' name.
        measured = cluster.calibrated is not None or any("(measured)" in d.name for d in cluster.devices)
        return replace(cluster, calibrated=str(path)) if measured else cluster

    @property
    def estimate_basis(self) -> str:
        """What the plan's times and throughput are estimated from, for the plan's text.

        Example:
            >>> Cluster.uniform(2, "H100-80GB").estimate_basis
            'estimated from the H100-80GB preset (roofline)'
        """
        names = list(dict.fromkeys(d.name for d in self.devices))
        if self.calibrated is not None:
            fitted = " and fitted to the model's step" if any("fitted to the model" in n for n in names) else ""
            return f"calibrated on {self.calibrated}{fitted}"
        described = [f"the {n} preset" if n in DEVICE_PRESETS else f"the device {n!r} as described" for n in names]
        return f"estimated from {', '.join(described)} (roofline)"

    def with_memory_reserve(self, reserve: float | str) -> Cluster:
        """This cluster with each device keeping ``reserve`` of its memory free (:func:`reserve_bytes`).

        Example:
            >>> Cluster.uniform(2, "A100-80GB").with_memory_reserve("1GiB").devices[1].usable_memory / 2**30
            79.0
        """
        devices = tuple(replace(d, memory_reserve=reserve_bytes(reserve, d.memory)) for d in self.devices)
        return replace(self, devices=devices)

    @staticmethod
    def load_details(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The ``details`` :meth:`save` wrote beside the cluster in ``path`` (``{}`` when none): a
        calibration's raw numbers, and what a fitted cluster was fitted on (``'fitted_to'``).

        Raises:
            FileNotFoundError, ClusterFormatError: as :meth:`load`.

        Example:
            >>> import tempfile
            >>> path = Cluster.uniform(2, "cpu").save(tempfile.mkdtemp() + "/c.json", details={"devices": 2})
            >>> Cluster.load_details(path)
            {'devices': 2}
        """
        Cluster.load(path)  # the same checks: a file that is not a cluster is refused alike
        details = json.loads(Path(path).read_text()).get("details")
        return dict(details) if isinstance(details, dict) else {}

    def with_devices(self, num_devices: int) -> Cluster:
        """The first ``num_devices`` devices of this cluster (for planning fewer stages)."""
        if not 1 <= num_devices <= len(self.devices):
            raise ClusterError(f"cluster has {len(self.devices)} devices, asked for {num_devices}")
        return replace(
            self,
            devices=self.devices[:num_devices],
            link_bandwidth=self.link_bandwidth[: num_devices - 1],
            link_latency=self.link_latency[: num_devices - 1],
        )


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)
