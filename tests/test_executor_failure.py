"""An action that fails raises its own error with the rank's program attached, the failed action
marked, as torch pipelining prints its schedule around a failure.

    python -m pytest tests/test_executor_failure.py -q
"""

from __future__ import annotations

import pytest
import torch

from commpipe.models.spec import resolve_model
from commpipe.parallel.comm import Comm
from commpipe.parallel.dims import ParallelDims
from commpipe.parallel.pipeline import build_stages
from commpipe.parallel.tensor import make_loss_fn
from commpipe.runtime.executor import PipelineRuntime
from commpipe.schedules import generate

MODEL = "arch=llama,layers=2,hidden=16,heads=2,kv_heads=2,ffn_hidden=32,vocab=32"


class Broken(RuntimeError):
    pass


def test_failed_action_is_marked_in_the_rank_program():
    spec = resolve_model(MODEL)
    b, s, m = 1, 8, 8
    program = generate("1f1b", 1, m)
    comm = Comm(ParallelDims(), 0)
    stages = build_stages(spec, program, 0, seed=0)
    forward, calls = stages[0].forward, []

    def fails_on_fifth_microbatch(*args, **kw):
        calls.append(len(calls))
        if len(calls) == 5:
            raise Broken("stage input has NaNs")
        return forward(*args, **kw)
    stages[0].forward = fails_on_fifth_microbatch

    runtime = PipelineRuntime(program, stages, comm, make_loss_fn(comm, None), (b, s, spec.hidden),
                              torch.device("cpu"))
    tokens = torch.randint(0, spec.vocab, (m, b, s + 1), generator=torch.Generator().manual_seed(0))
    with pytest.raises(Broken, match="stage input has NaNs") as info:
        runtime.run_step(list(tokens[..., :-1]), list(tokens[..., 1:]), torch.arange(s), 1.0, step=3)
    assert len(calls) == 5                      # nothing ran after the failed action
    # 1F1B on one rank: F and B alternate; the fifth forward (0F4) is action 8 of 16
    assert info.value.__notes__ == ["\n".join([
        "pp rank 0, step 3: action 0F4 failed (8 of 16 in schedule 1f1b's issue order):",
        "        ... 3 earlier",
        "         3  0B1",
        "         4  0F2",
        "         5  0B2",
        "         6  0F3",
        "         7  0B3",
        "    >>   8  0F4",
        "         9  0B4",
        "        10  0F5",
        "        11  0B5",
        "        12  0F6",
        "        13  0B6",
        "        ... 2 later",
    ])]
