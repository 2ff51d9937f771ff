"""The control plane's exposure (review M1): the embedded cluster is TLS-only with a per-run
certificate, so neither a plain tcp:// client nor a TLS client with another certificate can
submit code to it; `dtrain worker` without --host warns that it listens on every interface."""

from __future__ import annotations

import subprocess
import sys

import pytest
from distributed import Client
from distributed.security import Security

import dtrain
from dtrain.deploy.cluster import connect
from tests.helpers.paths import ROOT

DIGITS = ROOT / "pipelines" / "digits_async.yaml"


def _refused(address: str, security=None) -> bool:
    try:
        c = Client(address, timeout="3s", security=security, set_as_default=False)
    except Exception:  # OSError, TimeoutError, CommClosedError, TypeError (no ssl context)
        return True
    c.close()
    return False


def _check_embedded(processes: bool) -> None:
    spec = dtrain.load(DIGITS)
    with connect(spec, processes=processes) as conn:
        address = conn.client.scheduler.address
        assert address.startswith("tls://127.0.0.1:"), address
        # the run's own client works (it ran identity() in wait_for_tasks) and can run code ...
        assert conn.client.run_on_scheduler(lambda: 42) == 42
        # ... a stranger on the same host cannot: plain tcp to the TLS port, or TLS with its own CA
        assert _refused("tcp://" + address.split("://", 1)[1])
        assert _refused(address, Security.temporary())
        worker = next(iter(conn.workers()))
        assert worker.startswith("tls://127.0.0.1:"), worker
        assert _refused("tcp://" + worker.split("://", 1)[1])


def test_embedded_inprocess_cluster_refuses_plain_and_foreign_tls_clients():
    _check_embedded(processes=False)


@pytest.mark.processes
def test_embedded_nanny_cluster_refuses_plain_and_foreign_tls_clients():
    # in a child process, as `dtrain run` does (the nannies' resource tracker then ends with it)
    code = "from tests.deploy.test_security import _check_embedded; _check_embedded(True); print('checked')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and "checked" in out.stdout, out.stderr[-3000:]


def _worker(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtrain.cli", "worker", "--job", "ps", "--task", "0",
                           "--scheduler", "tcp://127.0.0.1:1", "--wait-s", "0.1", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_dtrain_worker_without_host_warns_it_listens_on_every_interface():
    out = _worker()
    assert out.returncode == 1  # nothing listens on port 1
    assert "listens on every network interface" in out.stderr and "--host" in out.stderr, out.stderr
    assert "without TLS anyone who reaches its port can run code" in out.stderr
    quiet = _worker("--host", "127.0.0.1")
    assert quiet.returncode == 1 and "every network interface" not in quiet.stderr, quiet.stderr
