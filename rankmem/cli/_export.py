"""``rankmem export RUN --parquet OUT``: the per-rank values as one Parquet table, for DuckDB, pandas or
polars. One row per (collect, rank): ``step``, ``time``, ``rank``, then one float64 column per key.
pyarrow is the ``parquet`` extra's, imported here only: the run log itself never needs it."""

from __future__ import annotations

import argparse

from rankmem.cli._common import add_run_argument, check_output, note_damage, require_steps
from rankmem.cli._runs import resolve_run
from rankmem.core.rundir import replace_file
from rankmem.errors import MissingExtraError, RankmemError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    parser.add_argument("--parquet", required=True, metavar="OUT", help="the Parquet file to write")


def run(args: argparse.Namespace) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingExtraError("rankmem export --parquet", "parquet", "pyarrow") from None
    import numpy as np  # here: `rankmem export --help` loads no numpy

    from rankmem.offline import read_run

    check_output(args.parquet, "--parquet")
    the_run = read_run(resolve_run(args.run, "export"))
    require_steps(the_run, "export")
    note_damage(the_run, "export")
    world, n = the_run.world_size, the_run.steps.size
    columns = {"step": np.repeat(the_run.steps, world), "time": np.repeat(the_run.times, world),
               "rank": np.tile(np.arange(world, dtype=np.int64), n)}
    columns.update({key: values.reshape(-1) for key, values in sorted(the_run.series.items())})
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink)
    try:
        replace_file(args.parquet, sink.getvalue().to_pybytes())
    except OSError as exc:
        raise RankmemError(f"cannot write {args.parquet}: {exc.strerror or exc}") from None
    print(f"wrote {args.parquet} ({n} collects x {world} ranks, {len(the_run.series)} keys)")
    return 0
