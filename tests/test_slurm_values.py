"""Values that land on #SBATCH lines are single Slurm tokens: a newline or shell text in --time,
--account, --qos or --constraint is refused before any script is written."""

from __future__ import annotations

import pytest

from commpipe.cluster.grids import Layout
from commpipe.cluster.slurm import SlurmOptions, sbatch_script

# sbatch's documented --time formats
GOOD_TIMES = ["30", "30:00", "00:30:00", "2-12", "2-12:30", "2-12:30:00", "UNLIMITED"]
BAD = [
    (dict(time="00:30:00\ntouch /tmp/pwned"), "--time"),
    (dict(time="1h"), "--time"),
    (dict(time="00:30:00 "), "--time"),
    (dict(account="m1234\n#SBATCH -p debug"), "--account"),
    (dict(account="m1234;id"), "--account"),
    (dict(qos="regular $(id)"), "--qos"),
    (dict(constraint="gpu`id`"), "--constraint"),
]


@pytest.mark.parametrize("time", GOOD_TIMES)
def test_slurm_time_formats_are_accepted(time, tmp_path):
    script = sbatch_script(Layout(tp=4), {}, tmp_path, SlurmOptions(time=time, constraint="gpu&hbm80g"))
    assert f"#SBATCH -t {time}\n" in script and "#SBATCH -C gpu&hbm80g\n" in script


@pytest.mark.parametrize("kw,flag", BAD, ids=[f"{f}={list(k.values())[0]!r}" for k, f in BAD])
def test_injected_slurm_values_are_refused(kw, flag):
    with pytest.raises(ValueError, match=flag):
        SlurmOptions(**kw)
