"""`ldm-ui`: the local web app to plan, launch, watch and resume runs, read their reports, sample and convert.

    pip install -e ".[ui]"
    ldm-ui [--logdir logs] [--root FOLDER ...] [--port 7860] [--listen]

It binds to 127.0.0.1: only this machine reaches it. `--listen` binds to every interface (anyone who reaches
the port can start runs and read the chosen folders). Paths typed into it must lie in a `--root` folder (by
default the current folder) or in the log folder.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ldm.cli import console

log = logging.getLogger("ldm")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="logs", type=Path, help="where runs go and are listed (default: logs)")
    parser.add_argument("--root", action="append", default=[], type=Path, metavar="FOLDER",
                        help="a folder the app may use (repeatable; default: the current folder)")  # fmt: skip
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--listen", action="store_true", help="bind to every interface, not only 127.0.0.1")
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' messages too")
    args = parser.parse_args(argv)
    console.setup(args.verbose)
    try:
        from ldm.ui.app import build_app
        from ldm.ui.runs import Roots
    except ImportError as err:
        print(f"ldm-ui needs the ui extra: pip install -e '.[ui]' ({err})", file=sys.stderr)
        return 2
    roots = Roots([*(args.root or [Path.cwd()]), args.logdir])
    app = build_app(roots, args.logdir)
    host = "0.0.0.0" if args.listen else "127.0.0.1"  # noqa: S104 - opt-in, and said
    if args.listen:
        log.warning("--listen: anyone who reaches port %d can start runs and read %s", args.port,
                    ", ".join(str(r) for r in roots.folders))  # fmt: skip
    log.info("ldm-ui: http://%s:%d (Ctrl-C stops it)", host, args.port)
    app.launch(server_name=host, server_port=args.port, inbrowser=False, share=False, quiet=True)
    return 0
