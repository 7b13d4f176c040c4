"""Scrapers that misbehave (issue 23): a client that connects and never sends, one that asks and never
reads, one that disappears mid-answer. None may slow the training loop or grow its memory; the endpoint
keeps answering a good scraper throughout."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from tests.conftest import REPO, free_port

pytest.importorskip("prometheus_client")

QUIET_S, ATTACK_S = 4.0, 10.0
RSS_BOUND = 8 * 2**20

TRAINER = textwrap.dedent("""
    import json, os, sys, time
    import rankmem
    from rankmem.sinks._prometheus import PrometheusSink

    quiet_s, attack_s, port = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    sink = PrometheusSink(port=port, timeout_s=1.0)
    m = rankmem.Monitor(sinks=[sink], device="cpu", children=False, leak_check=False)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    def run(seconds, step):
        steps, worst, peak = 0, 0.0, 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with m.step(step + steps):
                time.sleep(0.002)  # the step's compute
            t = time.perf_counter()
            m.collect({"loss": 1.0})
            worst = max(worst, time.perf_counter() - t)
            peak = max(peak, rss())
            steps += 1
        return steps, worst, peak

    run(1.0, 0)  # warm: the sink is open, its thread and the endpoint's started
    quiet = run(quiet_s, 10**6)
    base = rss()
    print("READY", flush=True)
    attack = run(attack_s, 2 * 10**6)
    m.close()
    print(json.dumps({"quiet_steps": quiet[0], "attack_steps": attack[0], "quiet_worst_s": quiet[1],
                      "attack_worst_s": attack[1], "rss_base": base, "rss_peak": attack[2]}), flush=True)
""")


def _rude_clients(port: int, seconds: float) -> dict[str, int]:
    """For ``seconds``: silent connections, askers that never read, and clients that reset mid-answer;
    a good scrape every 0.5 s. Returns how many of each, and the good scrapes' steps."""
    held: list[socket.socket] = []
    counts = {"silent": 0, "no_read": 0, "reset": 0, "good": 0, "first_step": -1, "last_step": -1}
    end, next_good, i = time.monotonic() + seconds, 0.0, 0
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    while time.monotonic() < end:
        i += 1
        kind = ("silent", "no_read", "reset")[i % 3]
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if kind != "silent":
            s.sendall(request)
        if kind == "reset":  # gone at once, with an RST rather than a FIN
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        else:
            held.append(s)
            if len(held) > 64:
                held.pop(0).close()
        counts[kind] += 1
        if time.monotonic() >= next_good:
            next_good = time.monotonic() + 0.5
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            step = int(float(next(line for line in text.splitlines() if line.startswith("rankmem_step{")).split()[-1]))
            counts["good"] += 1
            counts["last_step"] = step
            if counts["first_step"] < 0:
                counts["first_step"] = step
        time.sleep(0.01)
    for s in held:
        s.close()
    return counts


def test_rude_scrapers_neither_slow_training_nor_grow_its_memory() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(QUIET_S), str(ATTACK_S), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        counts = _rude_clients(port, ATTACK_S - 1.0)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    figures = json.loads(out.strip().splitlines()[-1])
    assert counts["silent"] > 50 and counts["no_read"] > 50 and counts["reset"] > 50, counts
    assert counts["good"] >= 10 and counts["last_step"] > counts["first_step"], counts
    quiet_rate = figures["quiet_steps"] / QUIET_S
    attack_rate = figures["attack_steps"] / ATTACK_S
    # The scrapers' threads share the 2 cores (and the GIL) with the loop: allowed to cost a little,
    # never to stall it.
    assert attack_rate >= 0.5 * quiet_rate, figures
    assert figures["attack_worst_s"] < 0.5, figures
    assert figures["rss_peak"] - figures["rss_base"] <= RSS_BOUND, figures
    assert "Traceback" not in err and "Exception" not in err, err
