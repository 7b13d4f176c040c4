"""The reference engine worker under real torchrun launches: learning, the run log's contents,
DDP/FSDP2 agreement, multi-node rendezvous, a failing rank and bad options (caught before any launch).
Every launch has a timeout; a launch costs seconds of startup, so the GRPO tests share one."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rankmem.cli import main
from rankmem.core.lock import RunDirLock
from tests.conftest import REPO, free_port, torchrun
from tests.runlog_helpers import read_log

ENTRY = "rankmem.engine.train"
CLI_TIMEOUT_S = 180


def train(out: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    argv = ["--out", str(out), "--no-progress", *args]
    proc = torchrun(ENTRY, nproc, argv, extra=["-m"], timeout=CLI_TIMEOUT_S)  # retries a port race once
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def cli(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "rankmem", "train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def series(steps: list[dict[str, Any]], key: str) -> list[float]:
    return [s["metrics"][key] for s in steps]


@pytest.mark.slow  # the GRPO launch below is the reference worker's representative
def test_sft_loss_falls_and_ddp_matches_fsdp(tmp_path: Path) -> None:
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    train(ddp, "--task", "sft", "--engine", "ddp", "--steps", "12")
    train(fsdp, "--task", "sft", "--engine", "fsdp", "--steps", "2")
    _, d = read_log(ddp)
    _, f = read_log(fsdp)
    loss = series(d, "loss/mean")
    assert [s["step"] for s in d] == list(range(12))
    # An untrained GPT predicts nearly uniformly over the 32 tokens: loss ~ ln 32.
    assert abs(loss[0] - math.log(32)) < 0.25
    assert loss[-1] < 0.8 * loss[0]
    # Same seed, same data, same global-token scaling: the engines agree before and after an update.
    for step in (0, 1):
        assert f[step]["metrics"]["loss/mean"] == pytest.approx(d[step]["metrics"]["loss/mean"], rel=1e-4)
        assert f[step]["metrics"]["grad_norm/mean"] == pytest.approx(d[step]["metrics"]["grad_norm/mean"], rel=1e-3)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One 40-step GRPO launch on FSDP2 (rollout and log_prob all-gather the shards), read by several
    tests: each launch costs seconds of startup, and the reward has plateaued (~0.6) by step 30."""
    out = tmp_path_factory.mktemp("grpo")
    return train(out, "--task", "grpo", "--engine", "fsdp", "--steps", "40").stdout, out


def test_grpo_reward_rises_and_run_log_has_every_key(grpo_run: tuple[str, Path]) -> None:
    stdout, out = grpo_run
    header, steps = read_log(out)
    assert header["world_size"] == 2 and [r["rank"] for r in header["ranks"]] == [0, 1]
    reward = series(steps, "reward/mean")
    assert sum(reward[-5:]) / 5 > sum(reward[:5]) / 5 + 0.15, reward
    assert sum(reward[-10:]) / 10 > 0.4, reward  # it keeps what it learned, not a lucky spike

    last = steps[-1]
    metrics, ranks = last["metrics"], last["ranks"]
    mem_keys = [k for k in ranks if k.startswith("mem/")]
    for key in ("mem/host/rss_gib", "mem/host/peak_rss_gib", "mem/node/used_gib"):
        assert key in mem_keys
    for key in mem_keys:  # per-rank vectors, aggregated consistently
        vec = ranks[key]
        assert len(vec) == 2, key
        if None not in vec:
            assert metrics[key + "/max"] == max(vec) and metrics[key + "/min"] == min(vec)
            assert int(metrics[key + "/max_rank"]) == vec.index(max(vec))
    for phase in ("rollout", "log_prob", "update"):
        assert ranks[f"mem/phase/{phase}/peak_rss_gib"][0] > 0.05  # a Python + torch process holds >50 MiB
    # A step's peak covers its phases.
    for r in (0, 1):
        assert ranks["mem/host/peak_rss_gib"][r] >= max(ranks[f"mem/phase/{p}/peak_rss_gib"][r] for p in ("rollout",
                                                                                                          "log_prob",
                                                                                                          "update"))
    assert metrics["perf/cpu_memory_used_gb"] == metrics["mem/host/rss_gib/max"]
    assert "perf/max_memory_allocated_gb" not in metrics  # no device on a CPU build: absent, not 0
    # Worker metrics, gathered in the same collective.
    assert metrics["lr/max"] == metrics["lr/min"] > 0
    assert steps[0]["metrics"]["lr/mean"] == pytest.approx(5e-3 / 6)  # first warmup step of 5
    assert metrics["grad_norm/min"] >= 0 and math.isfinite(metrics["grad_norm/max"])
    assert metrics["throughput/tokens_per_s/min"] > 0
    # MFU is tokens/s x FLOPs per token / peak (0.1 TFLOP/s on CPU), per rank.
    params = header["config"]["run"]["params"]
    flops_per_token = 6 * params + 12 * 3 * 96 * 32
    for r in (0, 1):
        assert ranks["mfu"][r] == pytest.approx(ranks["throughput/tokens_per_s"][r] * flops_per_token / 1e11, rel=1e-6)


def test_train_summary_names_the_peak_report_names(grpo_run: tuple[str, Path]) -> None:
    from rankmem.offline import read_run
    from rankmem.offline.report import build_report

    stdout, out = grpo_run
    peak = next(k for k in build_report(read_run(str(out / "rankmem.jsonl"))).keys if k.key == "mem/host/peak_rss_gib")
    # Every GRPO step is inside its three phases: one raised the peak, or the verdict names none of them.
    assert peak.phase_verdict in ("rose", "held", "tie") and set(peak.phases) <= {"rollout", "log_prob", "update"}
    phase = ["phase", peak.phase] if peak.phase_verdict == "rose" else peak.phase.split()
    lines = [line.split() for line in stdout.splitlines() if line.startswith("  mem/host/peak_rss_gib ")]
    assert lines == [["mem/host/peak_rss_gib", "max", f"{peak.value:.3f}", "GiB", "rank", str(peak.rank),
                      "step", str(peak.step), *phase]], stdout
    # What a GRPO user reads: reward, and the policy loss with digits (it is ~0 by construction);
    # a row of zeros (no dataloader workers) is left out; then what to run next.
    text = stdout.splitlines()
    assert any(line.startswith("reward (mean over ranks): 0.") for line in text), stdout
    assert any(re.fullmatch(r"pg_loss \(mean over ranks\): [+-]\d\.\d{3}e[+-]\d\d at step 0 -> .* at step 39", line)
               for line in text), stdout
    assert "children_rss_gib" not in stdout and "loss -0.000" not in stdout
    assert text[-4:] == ["next:", f"  rankmem report {out}   # per key and phase: the worst rank, step and phase; "
                         "leaks (--html FILE: a page)",
                         f"  rankmem plot {out}     # per-rank memory against step, capacity drawn: {out}/rankmem.png",
                         f"  rankmem watch {out}    # a live per-rank view, while a job writes there"]


def test_a_launch_into_an_earlier_runs_out_rotates_it_in_one_line(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from rankmem.cli._train import rotate_earlier_run

    (tmp_path / "rankmem.jsonl").write_text("{}\n")
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "rank0.jsonl").write_text("{}\n")
    rotate_earlier_run(str(tmp_path))
    why = "was from an earlier run (a restart into the same out_dir?); rotated it to"
    assert capsys.readouterr().err.splitlines() == [
        f"rankmem train: {tmp_path}/rankmem.jsonl {why} {tmp_path}/rankmem.jsonl.1",
        f"rankmem train: {tmp_path}/events {why} {tmp_path}/events.1",
    ]
    assert (tmp_path / "events.1" / "rank0.jsonl").exists() and not (tmp_path / "rankmem.jsonl").exists()
    rotate_earlier_run(str(tmp_path))  # nothing left to move: silent
    assert capsys.readouterr().err == ""


def test_two_torchrun_agents_form_one_job(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", "t2n",
              "--task", "sft", "--steps", "3", "--no-progress", "--timeout-s", "150"]
    agents = [cli(*common, "--node-rank", str(n), "--out", str(tmp_path / f"node{n}")) for n in (0, 1)]
    outputs = [a.communicate(timeout=CLI_TIMEOUT_S) for a in agents]
    for a, (out, err) in zip(agents, outputs, strict=True):
        assert a.returncode == 0, out[-2000:] + err[-2000:]
    # Exactly one agent hosts the logging rank; its run log lists both nodes' ranks.
    logs = [tmp_path / f"node{n}" for n in (0, 1) if (tmp_path / f"node{n}" / "rankmem.jsonl").exists()]
    assert len(logs) == 1
    header, steps = read_log(logs[0])
    assert header["world_size"] == 2
    assert sorted(r["rank"] for r in header["ranks"]) == [0, 1]
    assert [r["local_rank"] for r in header["ranks"]] == [0, 0]  # one process per node
    assert len({r["pid"] for r in header["ranks"]}) == 2
    assert len(steps) == 3 and all(len(v) == 2 for v in steps[-1]["ranks"].values())


@pytest.mark.slow  # a failing rank: test_launcher_faults3's own-error case
def test_failing_rank_fails_the_launch_and_keeps_the_log(tmp_path: Path) -> None:
    proc = cli("--task", "grpo", "--steps", "8", "--fail-at-step", "3", "--fail-rank", "1", "--no-progress",
               "--out", str(tmp_path), "--timeout-s", "150")
    out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode not in (0, 124), err[-2000:]
    assert "RuntimeError: injected failure on rank 1 at step 3 (--fail-at-step)" in err
    assert "rankmem train: the job failed" in err
    header, steps = read_log(tmp_path)  # every line parses
    assert header["kind"] == "header"
    assert [s["step"] for s in steps] == [0, 1, 2]


def test_multinode_without_endpoint_is_a_user_error() -> None:
    proc = cli("--nnodes", "2", "--node-rank", "1")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip() == ("rankmem train: error: --nnodes > 1 needs --rdzv-endpoint HOST:PORT, the same on every "
                           "node (e.g. node 0's address:29500)")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
        (["--group-size", "1"], "--group-size must be >= 2, got 1: GRPO's advantage is a response's reward against "
                                "its group's mean and standard deviation, which one response per prompt does not have"),
    ],
)
def test_bad_job_option_is_one_line_before_any_launch(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rankmem.cli import _train, main

    def no_launch(*a: object, **k: object) -> None:
        raise AssertionError("launched torchrun despite a bad option")

    monkeypatch.setattr(_train.subprocess, "Popen", no_launch)
    assert main(["train", *args]) == 2
    assert capsys.readouterr().err == f"rankmem train: error: {message}\n"


# torchrun's @record enables faulthandler on stderr, which pytest's capture has no file descriptor for.
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_entry_script_rejects_a_bad_job_option_before_joining(capsys: pytest.CaptureFixture[str]) -> None:
    from rankmem.engine import train as entry

    with pytest.raises(SystemExit) as info:  # no RANK in the environment: it would fail later if it got there
        entry.main(["--batch-size", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(": error: --batch-size must be >= 1, got 0")


def test_torchrun_command_passes_launch_options_through() -> None:
    import argparse

    from rankmem.cli import _train

    parser = argparse.ArgumentParser()
    _train.add_arguments(parser)
    args = parser.parse_args(["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29500",
                              "--task", "sft", "--steps", "5", "--engine", "fsdp", "--out", "runs/x"])
    cmd = _train.torchrun_command(args)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    launch = cmd[3:cmd.index("-m", 3)]
    assert launch == ["--nproc-per-node", "2", "--max-restarts", "0", "--nnodes", "2", "--node-rank", "1",
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29500", "--rdzv-id", "rankmem"]
    job = cmd[cmd.index(ENTRY) + 1:]
    assert job[job.index("--task") + 1] == "sft" and job[job.index("--engine") + 1] == "fsdp"
    assert job[job.index("--steps") + 1] == "5" and "--fail-at-step" not in job
    single = _train.torchrun_command(parser.parse_args([]))
    assert "--standalone" in single and "--rdzv-endpoint" not in single
    # `make demo`'s line: GRPO with its defaults, forwarded explicitly to every rank.
    job = single[single.index(ENTRY) + 1:]
    assert job[job.index("--task") + 1] == "grpo" and job[job.index("--steps") + 1] == "400"
    assert job[job.index("--lr") + 1] == "0.005"



def _earlier_run(out) -> str:
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "rankmem.jsonl")
    with open(log, "w") as f:
        f.write('{"kind": "header"}\n{"step": 0}\n')
    return log



def test_train_bad_option_does_not_rotate_earlier_run(tmp_path, capsys):
    """A user error (--steps 0) must be one line and exit 2 *before* anything is touched; instead the
    earlier run's log is moved aside to rankmem.jsonl.1 first."""
    out = tmp_path / "run"
    log = _earlier_run(out)
    rc = main(["train", "--steps", "0", "--device", "cpu", "--out", str(out)])
    assert rc == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert os.path.exists(log), sorted(os.listdir(out))  # fails: ['rankmem.jsonl.1']



def test_train_refused_by_lock_does_not_rotate_the_live_jobs_log(tmp_path, capsys):
    """A second `rankmem train --out DIR` while a job holds DIR is refused by the lock, but only after
    rotate_earlier_run() has renamed the live job's rankmem.jsonl (and events/): the running job keeps
    writing into rankmem.jsonl.1 through its open descriptor, and `rankmem watch/report DIR` lose it."""
    out = tmp_path / "run"
    log = _earlier_run(out)
    os.makedirs(out / "events")
    live = RunDirLock(str(out))
    live.acquire()  # the running job
    try:
        rc = main(["train", "--steps", "1", "--device", "cpu", "--out", str(out)])
    finally:
        live.release()
    assert rc == 2
    assert "in use by another rankmem job" in capsys.readouterr().err
    assert os.path.exists(log) and os.path.isdir(out / "events"), sorted(os.listdir(out))



def test_train_second_node_on_shared_out_is_not_refused(tmp_path, monkeypatch, capsys):
    """README's multi-node recipe runs the same line, same --out, on every node, and _train.py's
    rotate_earlier_run() expects 'another node's launcher sharing OUT'. But every node's launcher takes
    the exclusive OUT/.lock (lock_run_dir, _train.py run()), which the lock module says is arbitrated
    across nodes on NFS: on a shared --out, node 1 is refused as 'in use by another rankmem job'
    (exit 2) while node 0 waits for it at the rendezvous."""
    from rankmem.cli import _train

    out = tmp_path / "big"
    node0 = RunDirLock(str(out))
    node0.acquire()  # node 0's launcher, holding the lock for its whole job
    launched = []
    monkeypatch.setattr(_train, "launch", lambda args, cmd, lock: launched.append(cmd) or 0)
    try:
        rc = main(["train", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500",
                       "--nproc-per-node", "1", "--device", "cpu", "--steps", "1", "--out", str(out)])
    finally:
        node0.release()
    err = capsys.readouterr().err
    assert rc == 0 and launched, err  # fails: rc 2, "... is in use by another rankmem job ..."



def test_train_more_ranks_than_local_gpus_is_one_line(monkeypatch):
    """--device cuda (or auto on a GPU node) puts local rank r on cuda:r (engine/train.py
    init_distributed). check_local_device only asks whether CUDA is available, so on a 1-GPU node the
    default --nproc-per-node 2 gets past every check and rank 1 dies in set_device(cuda:1) with
    'invalid device ordinal' tracebacks instead of one line naming --nproc-per-node."""
    import argparse

    import torch

    from rankmem.cli import _train
    from rankmem.errors import RankmemError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = argparse.Namespace(device="cuda", nproc_per_node=2)
    with pytest.raises(RankmemError, match="nproc-per-node"):
        _train.check_local_device(args)  # fails: returns None, no error
