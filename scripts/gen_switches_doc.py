"""Write the switches table of docs/configuration.md ("Switches") from shared/switches.py.

  .venv/bin/python scripts/gen_switches_doc.py          # rewrite the table in place
  .venv/bin/python scripts/gen_switches_doc.py --check  # exit 1 when the doc differs

tests/unit/test_switches.py runs the same comparison, so the doc cannot drift from the registry.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlxcel.shared.switches import render_doc

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a change")
    args = parser.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    new = render_doc(text)
    if new == text:
        return 0
    if args.check:
        print(f"{DOC} is out of date: run scripts/gen_switches_doc.py", file=sys.stderr)
        return 1
    DOC.write_text(new, encoding="utf-8")
    print(f"wrote the switches table of {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
