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

SLICES, QUIET_S, ATTACK_S = 5, 1.0, 1.5
RSS_BOUND = 8 * 2**20

# The loop runs until the test writes a line to its stdin, recording when each step ended and how long its
# collect took; the test alternates quiet and attacked slices against it and counts the steps in each, so
# whatever else loads the machine weighs on both kinds of slice alike.
TRAINER = textwrap.dedent("""
    import json, os, sys, threading, time
    import rankmem
    from rankmem.sinks._prometheus import PrometheusSink

    port = int(sys.argv[1])
    sink = PrometheusSink(port=port, timeout_s=1.0)
    m = rankmem.Monitor(sinks=[sink], device="cpu", children=False, leak_check=False)
    page = os.sysconf("SC_PAGE_SIZE")
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    def run(until, step):
        ends, collects, peak = [], [], 0
        while not until():
            with m.step(step + len(ends)):
                time.sleep(0.002)  # the step's compute
            t = time.perf_counter()
            m.collect({"loss": 1.0})
            collects.append(time.perf_counter() - t)
            ends.append(time.monotonic())
            peak = max(peak, rss())
        return ends, collects, peak

    warm_end = time.monotonic() + 1.0
    run(lambda: time.monotonic() > warm_end, 0)  # warm: the sink is open, its thread and the endpoint's started
    base = rss()
    print("READY", flush=True)
    ends, collects, peak = run(stop.is_set, 10**6)
    m.close()
    print(json.dumps({"ends": ends, "collects": collects, "rss_base": base, "rss_peak": peak}), flush=True)
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


def _within(t: float, slices: list[tuple[float, float]]) -> bool:
    return any(a <= t < b for a, b in slices)


def _rate(ends: list[float], slices: list[tuple[float, float]]) -> tuple[int, float]:
    """How many steps ended inside ``slices``, and how many a second."""
    steps = sum(1 for t in ends if _within(t, slices))
    return steps, steps / sum(b - a for a, b in slices)


def test_rude_scrapers_neither_slow_training_nor_grow_its_memory() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    quiet: list[tuple[float, float]] = []
    attacked: list[tuple[float, float]] = []
    rounds: list[dict[str, int]] = []
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        for _ in range(SLICES):
            a = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine
            time.sleep(QUIET_S)
            quiet.append((a, time.monotonic()))
            a = time.monotonic()
            rounds.append(_rude_clients(port, ATTACK_S))
            attacked.append((a, time.monotonic()))
        out, err = proc.communicate("stop\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    figures = json.loads(out.strip().splitlines()[-1])
    counts = {k: sum(r[k] for r in rounds) for k in ("silent", "no_read", "reset", "good")}
    counts["first_step"], counts["last_step"] = rounds[0]["first_step"], rounds[-1]["last_step"]
    assert counts["silent"] > 50 and counts["no_read"] > 50 and counts["reset"] > 50, counts
    assert counts["good"] >= 10 and counts["last_step"] > counts["first_step"], counts
    quiet_steps, quiet_rate = _rate(figures["ends"], quiet)
    _, attack_rate = _rate(figures["ends"], attacked)
    # No step at all under attack is a stall: the worst collect is then infinite, and fails below.
    worst_attacked = max((c for t, c in zip(figures["ends"], figures["collects"], strict=True)
                          if _within(t, attacked)), default=float("inf"))
    report = {"quiet_rate": quiet_rate, "attack_rate": attack_rate, "worst_collect_s": worst_attacked,
              "rss_grew": figures["rss_peak"] - figures["rss_base"]}
    # The scrapers' threads share the 2 cores (and the GIL) with the loop: allowed to cost a little,
    # never to stall it.
    assert quiet_steps > 100 and attack_rate >= 0.5 * quiet_rate, report
    assert worst_attacked < 0.5, report
    assert report["rss_grew"] <= RSS_BOUND, report
    assert "Traceback" not in err and "Exception" not in err, err
