"""The pod's process, as a kubelet would run it: started in a session of its own with its output
appended to the pod's log file (pod dir/log, one `--- start` line per start), restarted after
an exit as restartPolicy says (with a back-off), readiness-probed (httpGet, tcpSocket, exec),
and stopped by SIGTERM to its process group, SIGKILL after the grace period."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.request

from e2e.podrunner.kube import now
from e2e.podrunner.pods import Container, RunPod
from e2e.podrunner.translate import port_words
from relay.fleet.contract import Obj

log = logging.getLogger("e2e.podrunner")

PROBE_S = 1.0


def spawn(pod: RunPod, argv: list[str] | None = None) -> None:
    """Start the pod's process; without `argv`, the one it was last started with (a restart)."""
    c = pod.container
    assert c is not None
    if argv is None:
        argv = json.loads((pod.dir / "argv.json").read_text())
    (pod.dir / "argv.json").write_text(json.dumps(argv))
    with (pod.dir / "log").open("ab") as out:
        out.write(f"--- start {now()}: {shlex.join(argv)}\n".encode())
        out.flush()
        c.proc = subprocess.Popen(
            argv,
            env=c.env,
            cwd=c.cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    c.started_at, c.ready, c.exit_code = now(), False, None
    pod.phase = "Running"
    log.info("pod %s: started pid %d (%s)", pod.name, c.proc.pid, os.path.basename(argv[0]))


def supervise(pod: RunPod) -> None:
    """One look at the pod's process: restart it when due, note an exit, probe readiness."""
    c = pod.container
    if c is None or pod.phase != "Running" or pod.deleting_since:
        return
    if c.proc is None:
        if c.restart_at and time.monotonic() >= c.restart_at:
            c.restart_at = 0.0
            spawn(pod)
        return
    code = c.proc.poll()
    if code is not None:
        c.exit_code, c.ready = code, False
        log.info("pod %s: exited %d", pod.name, code)
        policy = pod.spec.get("restartPolicy", "Always")
        if policy == "Always" or (policy == "OnFailure" and code != 0):
            c.restarts += 1
            c.restart_at = time.monotonic() + min(5.0, 0.5 * c.restarts)  # a kubelet's back-off
        else:
            pod.phase = "Succeeded" if code == 0 else "Failed"
        c.proc = None
        return
    if time.monotonic() - c.last_probe >= PROBE_S:
        c.last_probe = time.monotonic()
        probe = pod.spec["containers"][0].get("readinessProbe")
        if probe is None:
            c.ready = True
        elif run_probe(probe, c):
            c.failures = 0
            c.ready = True
        else:
            # As a kubelet: ready until failureThreshold probes in a row fail.
            c.failures += 1
            if not c.ready or c.failures >= int(probe.get("failureThreshold", 3)):
                c.ready = False


def run_probe(probe: Obj, c: Container) -> bool:
    try:
        if "httpGet" in probe:
            port = c.ports[str(probe["httpGet"]["port"])]
            url = f"http://127.0.0.1:{port}{probe['httpGet'].get('path', '/')}"
            with urllib.request.urlopen(url, timeout=2) as resp:
                return 200 <= int(resp.status) < 400
        if "tcpSocket" in probe:
            with socket.create_connection(("127.0.0.1", c.ports[str(probe["tcpSocket"]["port"])]), 2):
                return True
        if "exec" in probe:
            argv = [port_words(a, c.ports) for a in probe["exec"]["command"]]
            done = subprocess.run(argv, env=c.env, cwd=c.cwd, capture_output=True, timeout=5, check=False)
            return done.returncode == 0
    except (OSError, KeyError, subprocess.TimeoutExpired, ValueError):
        return False
    return False


def kill(pod: RunPod, grace: int) -> None:
    c = pod.container
    if c is None or c.proc is None or c.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(c.proc.pid, signal.SIGTERM)
    try:
        c.proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.proc.pid, signal.SIGKILL)
        c.proc.wait(5)
    log.info("pod %s: stopped", pod.name)
