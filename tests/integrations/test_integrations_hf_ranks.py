"""The Hugging Face integration on 2 ranks (torchrun, gloo): a tiny random Llama with padded micro-batches
and ``attach(trainer)`` alone, read back with rankmem's own CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rankmem.offline import read_run
from tests.conftest import torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests/dist_scripts/hf_llama_worker.py"
MIB = 2**20
# glibc hands freed blocks back (docs/advice.md): each window's host peak is its own.
HEAP = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankmem", *argv], capture_output=True, text=True,
                          timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 steps, logging_steps=500 (one Trainer log in the job), rank 1 holding 64 MiB more in step 10."""
    out = tmp_path_factory.mktemp("hf") / "run"
    argv = [str(out), "--steps", "30", "--logging-steps", "500", "--jump-step", "10", "--trim"]
    proc = torchrun(WORKER, 2, argv,
                    timeout=300, env={**os.environ, **HEAP})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_a_rank_s_step_10_jump_is_reported_at_step_10_whatever_logging_steps(job: Path) -> None:
    run = read_run(str(job))
    rss = run.series["mem/host/rss_gib"] * 1024
    at = list(run.steps).index(10)
    assert rss[at, 1] - rss[at - 1, 1] == pytest.approx(64, abs=8)  # the numpy block, whole pages
    assert abs(rss[at, 0] - rss[at - 1, 0]) < 8
    report = json.loads(_cli("report", str(job), "--json").stdout)
    worst = {w["key"]: w for w in report["worst"]}["mem/host/peak_rss_gib"]
    assert (worst["step"], worst["rank"]) == (10, 1)


def test_a_finished_run_has_one_record_per_step_and_leaks_read_it_by_step(job: Path) -> None:
    run = read_run(str(job))
    assert run.steps.tolist() == list(range(1, 31))  # no second record for the Trainer's final summary
    assert not np.isnan(run.series["mem/host/rss_gib"]).any()
    leaks = _cli("leaks", str(job))
    assert leaks.returncode == 0, leaks.stdout + leaks.stderr
    assert "do not rise" not in leaks.stdout + leaks.stderr
    watch = _cli("watch", str(job), "--once")
    assert watch.returncode == 0 and "damaged" not in watch.stdout + watch.stderr
    assert "step 30" in watch.stdout


def test_advise_on_a_padded_job_with_attach_alone_names_the_hf_setting(job: Path) -> None:
    done = _cli("advise", str(job), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout)
    binding = next(r for r in rows if r["binding"])
    # Padded to at most 128 tokens (--max-len): the batch size is the advised tokens over that width.
    width = max(read_run(str(job)).series["mem/phase/train_step/heaviest_mb_sq_tokens"].ravel()
                / read_run(str(job)).series["mem/phase/train_step/heaviest_mb_tokens"].ravel())
    assert width <= 128
    batch_size = binding["max_tokens"] // round(width)
    assert binding["setting"] == {"TrainingArguments.per_device_train_batch_size": batch_size}
    text = _cli("advise", str(job)).stdout
    assert "TrainingArguments.per_device_train_batch_size=" in text
