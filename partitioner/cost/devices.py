"""Device and cluster descriptions: peak speed, memory bandwidth, capacity, and the links between stages."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.errors import ClusterError, ClusterFormatError, UnknownDeviceError

if TYPE_CHECKING:
    from partitioner.cost.calibrate import Calibration
    from partitioner.cost.probes import Probe

__all__ = ["DeviceSpec", "Cluster", "DEVICE_PRESETS"]

_GB = 1e9
_GIB = 2**30
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

    Example:
        >>> DeviceSpec.preset("A100-80GB").memory / 2**30
        80.0
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
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "V100-32GB": DeviceSpec("V100-32GB", 125e12, 15.7e12, 900 * _GB, 32 * _GIB, 150 * _GB, 10e-6,
                            node_size=8, inter_node_bandwidth=12.5 * _GB),
    "A100-40GB": DeviceSpec("A100-40GB", 312e12, 19.5e12, 1555 * _GB, 40 * _GIB, 300 * _GB, 10e-6,
                            node_size=8, inter_node_bandwidth=25 * _GB),
    "A100-80GB": DeviceSpec("A100-80GB", 312e12, 19.5e12, 2039 * _GB, 80 * _GIB, 300 * _GB, 10e-6,
                            node_size=8, inter_node_bandwidth=25 * _GB),
    "H100-80GB": DeviceSpec("H100-80GB", 989e12, 67e12, 3350 * _GB, 80 * _GIB, 450 * _GB, 8e-6,
                            node_size=8, inter_node_bandwidth=50 * _GB),
    "H200-141GB": DeviceSpec("H200-141GB", 989e12, 67e12, 4800 * _GB, 141 * _GIB, 450 * _GB, 8e-6,
                             node_size=8, inter_node_bandwidth=50 * _GB),
    "L4-24GB": DeviceSpec("L4-24GB", 121e12, 30.3e12, 300 * _GB, 24 * _GIB, 32 * _GB, 15e-6,
                          node_size=8, inter_node_bandwidth=1.5 * _GB),
    # One CPU core running fp32 matmuls; gloo over loopback between processes.
    "cpu": DeviceSpec("cpu", 50e9, 50e9, 10 * _GB, _cpu_memory(), 2 * _GB, 50e-6, 2e-6),
}


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
    ) -> Cluster:
        """``num_devices`` identical devices in a chain with identical links.

        Args:
            num_devices: how many devices (one stage each).
            device: a preset name (see ``DEVICE_PRESETS``) or a ``DeviceSpec``.
            link_bandwidth: bytes/s between neighbours; defaults to the device's preset link.
            link_latency: seconds per transfer; defaults to the device's preset latency.
        """
        if num_devices < 1:
            raise ClusterError(f"num_devices must be at least 1, got {num_devices}")
        spec = DeviceSpec.preset(device) if isinstance(device, str) else device
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
        for key in ("collective_bandwidth", "collective_latency", "cores"):
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
        )
        base = Cluster.uniform(cal.devices, spec)
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
            return Cluster.from_dict(doc["cluster"])
        except ClusterError as e:
            raise ClusterFormatError(f"{path}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ClusterFormatError(
                f"{path} holds a cluster that cannot be read ({type(e).__name__}: {e}); measure it again "
                f"with `pipecut calibrate --out {path}`"
            ) from None

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
