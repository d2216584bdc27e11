"""A sweep stopped by a signal: a real `commpipe sweep` process gets SIGTERM while a layout trains;
its torchrun job must be gone within seconds, the layout recorded as interrupted, the exit code
128 + 15. An emulated sweep killed with SIGKILL leaves its namespace prefix in OUT/cluster.json,
from which `commpipe cluster down --sweep OUT` removes what is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

REPO = Path(__file__).resolve().parents[1]
GRID = '[train]\nmodel = "tiny"\nseq_len = 16\nsteps = 100000\n\n[[layout]]\npp = 2\n\n[[layout]]\ndp = 2\n'


def _sweep(tmp_path, *flags) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "g.toml").write_text(GRID)
    out = tmp_path / "sweep"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "commpipe", "sweep", "--grid", str(tmp_path / "g.toml"),
                             "--out", str(out), "--no-progress", "--comm-monitor", "off", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return proc, out


def _wait_for(predicate, proc, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended before {what}: {proc.stdout.read()}")
        time.sleep(0.5)
    proc.kill()
    pytest.fail(f"no {what} within {timeout_s:.0f} s: {proc.stdout.read()}")


def _alive(pids) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.slow
def test_sigterm_stops_the_layout_and_records_it(tmp_path):
    proc, out = _sweep(tmp_path, "--cluster", "local", "--timeout", "600")
    sweep = psutil.Process(proc.pid)

    def training():   # torchrun and its two ranks, and the first step written
        kids = sweep.children(recursive=True)
        return kids if len(kids) >= 3 and (out / "tp1-cp1-pp2-dp1" / "metrics.jsonl").exists() else None

    kids = _wait_for(training, proc, 240, "training layout")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while _alive(k.pid for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _alive(k.pid for k in kids)
        assert not left, f"left running: {[' '.join(psutil.Process(p).cmdline()[:6]) for p in left]}"
    finally:
        for pid in _alive(k.pid for k in kids):      # a failed check leaves no job behind
            os.kill(pid, signal.SIGKILL)
    assert time.monotonic() - t0 < 20
    assert proc.returncode == 128 + signal.SIGTERM, output
    recs = [json.loads(x) for x in (out / "sweep.jsonl").read_text().splitlines()]
    assert [(r["name"], r["status"]) for r in recs] == [("tp1-cp1-pp2-dp1", "interrupted")]
    assert "SIGTERM" in recs[0]["reason"] and "SIGTERM" in output


@pytest.mark.slow
def test_killed_emulated_sweep_leaves_its_prefix(tmp_path):
    from commpipe.cluster import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"no emulated cluster here: {why}")
    proc, out = _sweep(tmp_path, "--cluster", "emulated", "--nodes", "1", "--ranks-per-node", "2")

    def cluster_file():
        try:
            return json.loads((out / "cluster.json").read_text())
        except (OSError, ValueError):      # not written yet, or half written
            return None

    info = _wait_for(cluster_file, proc, 120, "cluster.json")
    prefix = info["prefix"]
    _wait_for(lambda: any(netns.list_resources(prefix).values()), proc, 60, "namespaces")
    proc.send_signal(signal.SIGKILL)
    output, _ = proc.communicate(timeout=30)
    assert f"commpipe cluster down --prefix {prefix}" in output      # printed at the start
    try:
        assert any(netns.list_resources(prefix).values())         # SIGKILL: nothing cleaned up
        done = subprocess.run([sys.executable, "-m", "commpipe", "cluster", "down", "--sweep", str(out)],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert done.returncode == 0, done.stderr
        assert prefix in done.stdout
        assert not any(netns.list_resources(prefix).values())
    finally:
        netns.cleanup_stale(prefix)


def test_the_layout_demo_stops_on_sigterm_as_a_sweep_does(tmp_path, monkeypatch, capsys):
    """`commpipe demo`: SIGTERM while its sweep runs ends with the sweep's word and 128 + 15 (the
    sweep records the layout in progress; test above), not Python's silent default death.
    The signal is real, sent to this process while the demo's sweep is in its place."""
    import argparse

    from commpipe import demo
    from commpipe.cluster import sweep

    def sweep_that_gets_sigterm(out, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the demo's sweep")

    def unhandled(signum, frame):       # the demo left SIGTERM to whatever was there before
        raise AssertionError("the demo did not handle SIGTERM")

    before = signal.signal(signal.SIGTERM, unhandled)
    monkeypatch.setattr(sweep, "run_demo_sweep", sweep_that_gets_sigterm)
    args = argparse.Namespace(out=str(tmp_path / "demo"), steps=2, cluster="local",
                              inter_node_mbit=50.0, adaptive=False, elastic=False,
                              emulate_device=1.0)
    try:
        code = demo.run(args)
        put_back = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 128 + signal.SIGTERM
    assert put_back is unhandled                    # the demo put the handler back
    err = capsys.readouterr().err
    assert "SIGTERM: the sweep stopped" in err and str(tmp_path / "demo") in err
