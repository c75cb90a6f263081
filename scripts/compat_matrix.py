"""Print (or write into docs/COMPAT.md) the experts-implementation compatibility matrix of the installed transformers.

    python scripts/compat_matrix.py                    # print the table (about a minute on one CPU core)
    python scripts/compat_matrix.py --write docs/COMPAT.md
    python scripts/compat_matrix.py --only qwen3_moe,mixtral

Rows and checks: moefx/integrations/transformers_compat.py. Exit status 1 when a row fails a check that grouped_mm
passes (the CI test, tests/test_compat_matrix.py, asserts the same).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

BEGIN, END = "<!-- compat-matrix:begin -->", "<!-- compat-matrix:end -->"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="replace the table between the markers of this markdown file")
    parser.add_argument("--only", default="", help="comma-separated model types")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    from moefx.integrations import transformers_compat as tc

    logging.set_verbosity_error()
    only = {t for t in args.only.split(",") if t}
    start = time.perf_counter()
    rows = tc.run_matrix((lambda t: t in only) if only else None)
    table = tc.markdown(rows)
    bad = {r.model_type: tc.failures(r) for r in rows if tc.failures(r)}
    print(table)
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s; failing: {bad or 'none'}", file=sys.stderr)
    if args.write:
        text = args.write.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        args.write.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
