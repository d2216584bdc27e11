"""Every pipeline schedule computes what one device computes (loss, pre-clip gradients,
parameters), with pp in {2, 4} and beside tp, dp and cp; zero-bubble schedules exercise the
deferred weight-gradient path (I/W split), V schedules the local hand-over between two chunks
on one rank.
"""

from __future__ import annotations

import pytest

from commpipe.parallel.dims import ParallelDims
from tests.dist_harness import run_jobs
from tests.reference import reference_run
from tests.test_equivalence import check_against, make_cfg

# 8 layers so that pp=4 with two chunks per rank still has a layer per stage
MODEL = "arch=llama,layers=8,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,vocab=128"
SCHEDULES = [("interleaved", 2), ("zbh1", 1), ("zbv", 1)]


def cfg(dims, schedule, vpp):
    return make_cfg(dims, schedule, vpp=vpp, model=MODEL)


@pytest.fixture(scope="module")
def reference():
    return reference_run(cfg(ParallelDims(), "1f1b", 1))


@pytest.mark.parametrize("world", [2, 4])
def test_schedules_match_single_device(world, reference):
    layouts = [ParallelDims(pp=world)]
    if world == 4:  # the I/W split under tensor, data and context parallelism
        layouts += [ParallelDims(pp=2, tp=2), ParallelDims(pp=2, dp=2), ParallelDims(pp=2, cp=2)]
    jobs = [(f"{d}-{name}-v{v}", cfg(d, name, v)) for d in layouts for name, v in SCHEDULES]
    for key, got in run_jobs(world, jobs).items():
        check_against(reference, got, key)
