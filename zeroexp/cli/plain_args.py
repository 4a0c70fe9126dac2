"""The plain-argument command lines' shared start (``python -m zeroexp.checkpoint``, ``python -m zeroexp.explain``):
their arguments, or their help."""

from __future__ import annotations

import sys

__all__ = ["args_or_help"]


def args_or_help(argv: list[str] | None, doc: str, usage: str) -> list[str]:
    """The command's arguments (``argv``, else the process's); with ``-h`` / ``--help`` the first paragraph of
    ``doc`` and ``usage`` printed and exit 0, with none of them exit 2."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(doc.split("\n\n")[0] + "\n\n" + usage)
        raise SystemExit(0 if args else 2)
    return args
