"""The trainer's TensorParallel option (runtime.options) and what tensor parallelism refuses before
any process group or weight is touched (runtime.parallel.tensor_stages), in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import Plan, partition
from runtime.errors import TrainerOptionError
from runtime.options import DataParallel, Init, TensorParallel, TrainerOptions, resolve_options
from runtime.parallel.tensor_stages import TensorParallelOptionError, refuse_unsupported
from runtime.trainer import PipelineTrainer
from runtime.transport.placement import PlacementError


def _plan() -> Plan:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return partition(model, (torch.randn(2, 8),), 2, microbatches=2)


def test_the_option_is_frozen_hashable_and_an_int_is_its_size() -> None:
    tp = TensorParallel(size=2, plan={"mlp.up": "colwise", "mlp.down": "rowwise"})
    assert tp.patterns() == {"mlp.up": "colwise", "mlp.down": "rowwise"} and hash(tp)
    assert resolve_options(tensor_parallel=2).tensor_parallel == TensorParallel(size=2)
    assert resolve_options() == TrainerOptions(resolve_options().execution, Init(), DataParallel(), TensorParallel())
    with pytest.raises(TrainerOptionError, match=r"TensorParallel\(size=0\).*int >= 1"):
        TensorParallel(size=0)


def test_tensor_parallelism_in_one_process_is_refused_with_the_launch_command() -> None:
    with pytest.raises(PlacementError, match=r"TensorParallel\(size=2\).*torchrun --nproc-per-node 4"):
        PipelineTrainer(_plan(), nn.functional.mse_loss, transport="local", tensor_parallel=2)


@pytest.mark.parametrize(("opts", "words"), [
    ({"engine": "fsdp"}, r"DataParallel\(engine='fsdp'.*2-D.*engine='replicate'"),
])
def test_what_does_not_compose_with_tp_yet_is_refused_naming_both(opts: dict[str, object], words: str) -> None:
    kw = {"engine": "replicate", **opts}
    refuse_unsupported(1, **kw)  # type: ignore[arg-type]  # tp 1: nothing to refuse
    with pytest.raises(TensorParallelOptionError, match=r"TensorParallel\(size=2\) with " + words):
        refuse_unsupported(2, **kw)  # type: ignore[arg-type]


def test_the_trainer_refuses_fsdp_with_tp_before_joining_a_process_group() -> None:
    with pytest.raises(TensorParallelOptionError, match="engine='fsdp'"):
        PipelineTrainer(_plan(), nn.functional.mse_loss, transport="local", tensor_parallel=2,
                        data_parallel=DataParallel(size=2, engine="fsdp"))


def test_every_pipeline_of_the_job_one_per_replica_and_tp_rank() -> None:
    from runtime.parallel.data_parallel import PipelineMesh

    # 2 dp x 2 pp x 2 tp: world rank (d * pp + r) * tp + t; this process is d 1, r 0, t 1 (rank 5).
    mesh = PipelineMesh(2, 2, 1, 0, ((1, 3), (5, 7)), tp=2, tp_rank=1)
    assert mesh.pipelines == ((0, 2), (1, 3), (4, 6), (5, 7))  # the tie groups are made over these
    assert mesh.pipelines[mesh.pipeline] == mesh.ranks[mesh.dp_rank] == (5, 7)
    plain = PipelineMesh(2, 2, 1, 1, ((0, 1), (2, 3)))  # without tp: the replicas' pipelines
    assert (plain.pipelines, plain.pipeline) == (plain.ranks, 1)
