"""`python -m e2e.podrunner --kubeconfig K --namespace NS --node NODE --workdir DIR` (see the
package's docstring); SIGTERM or SIGINT stops every pod and unregisters the node."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from e2e import podrunner
from e2e.podrunner.kube import Api
from e2e.podrunner.runner import Runner


def main(argv: list[str] | None = None) -> int:
    assert podrunner.__doc__ is not None
    parser = argparse.ArgumentParser(
        prog="python -m e2e.podrunner", description=podrunner.__doc__.split("\n\n")[0]
    )
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        runner = Runner(Api(args.kubeconfig), args.namespace, args.node, workdir)
    except Exception as exc:  # a bad kubeconfig: one line, not a traceback
        print(f"podrunner: cannot use {args.kubeconfig}: {exc}", file=sys.stderr)
        return 1

    def stop(_sig: int, _frame: Any) -> None:
        runner.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        runner.run()
    finally:
        runner.node.unregister()
    return 0


if __name__ == "__main__":
    sys.exit(main())
