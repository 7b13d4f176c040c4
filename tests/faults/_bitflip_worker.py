"""Run by tests/faults/test_bitflip_faults.py in a subprocess of its own (a crash must not take
pytest with it): for each flip, flip one bit of a run's file, run report, leaks, watch (and
plot on some) through the real CLI in this process, restore the byte, and append one JSON line of
what each said. Usage: python _bitflip_worker.py RUN FLIPS.json OUT.jsonl"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import traceback
from typing import Any

from rankmem.cli import main
from rankmem.offline.watch import Watcher


def call(argv: list[str]) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc: Any = main(argv)
        except SystemExit as exc:
            rc = exc.code
        except BaseException:  # noqa: BLE001 - what the test counts as a traceback
            traceback.print_exc(file=err)
            rc = "traceback"
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}


def frame(run: str) -> dict[str, Any]:
    try:
        return {"frame": json.loads(json.dumps(dataclasses.asdict(Watcher(run).frame(now=2e9)), default=str))}
    except BaseException:  # noqa: BLE001
        return {"frame": None, "err": traceback.format_exc()}


def main_loop(run: str, flips_path: str, out_path: str) -> None:
    with open(flips_path) as f:
        flips = json.load(f)
    png = os.path.join(os.path.dirname(out_path), "flip.png")
    with open(out_path, "a") as log:
        for flip in flips:
            name, byte, bit, plot = flip["file"], flip["byte"], flip["bit"], flip["plot"]
            path = os.path.join(run, name) if name else None
            original = None
            if path is not None:
                with open(path, "r+b") as f:
                    f.seek(byte)
                    original = f.read(1)
                    f.seek(byte)
                    f.write(bytes([original[0] ^ (1 << bit)]))
            log.write(json.dumps({"start": flip}) + "\n")
            log.flush()
            result = {
                "flip": flip,
                "report": call(["report", "--json", run]),
                "leaks": call(["leaks", "--json", run]),
                "watch": call(["watch", "--once", run]),
                **frame(run),
            }
            if plot:
                result["plot"] = call(["plot", run, "-o", png])
            if path is not None and original is not None:
                with open(path, "r+b") as f:
                    f.seek(byte)
                    f.write(original)
            log.write(json.dumps(result) + "\n")
            log.flush()


if __name__ == "__main__":
    main_loop(*sys.argv[1:4])
