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
    """Whether a Client to ``address`` is refused the way a stranger is: an OSError (a dropped or
    failed handshake: CommClosedError, ssl.SSLError, a connect timeout are all OSErrors). Any other
    error (a TypeError of a bad argument, a bug of the test's) is raised, not counted as refused."""
    try:
        c = Client(address, timeout="3s", security=security, set_as_default=False)
    except OSError:
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
        # ... and so does a second client with the run's certificate (the positive control: the
        # checks below can fail) ...
        assert not _refused(address, conn.client.security)
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


def test_tls_cluster_gets_a_tls_data_plane_with_each_workers_own_certificate(tmp_path):
    """Review M2: on a TLS cluster (here the embedded one) the data plane is TLS even without
    cluster.security, each ps serving with its own worker's certificate; and nothing the chief
    ships to the ps or the replicas holds a private key (it once sent the client's key, read from
    cluster.security, to every ps and replica)."""
    import pickle
    import socket
    import ssl

    import torch

    from dtrain.chief.ps_shards import ShardGroup
    from dtrain.dataplane.protocol import MAGIC, client_ssl_context
    from dtrain.worker.tasks import tls_pems

    # cluster.security names real key files (for the chief's own connections): they must stay here
    other = tls_pems(Security.temporary())
    files = {}
    for name in ("ca", "cert", "key"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text(other[name])
    spec = dtrain.load(DIGITS, overrides=[f"cluster.security.{k}_file={files[k]}" for k in files])
    with connect(spec, processes=False) as conn, conn.client.as_current():
        plan = dtrain.compile(spec)
        group = ShardGroup(conn, spec, plan, token="m2")
        try:
            group.create([torch.zeros(s.numel) for s in plan.shards])
            dp = group.data_plane
            assert dp["tls"] is True
            shipped = pickle.dumps((dp, [group._config(s.index) for s in plan.shards]))
            assert b"PRIVATE KEY" not in shipped
            host, port = dp["endpoints"][0]
            with socket.create_connection((host, port), timeout=2) as raw:  # plaintext: no greeting
                with pytest.raises(OSError):  # (a timeout: the server waits for a TLS hello)
                    raw.recv(len(MAGIC))
            mine = tls_pems(conn.cluster.security)  # the run's certificate: what its workers hold
            with client_ssl_context(mine).wrap_socket(socket.create_connection((host, port), timeout=5)) as tls:
                assert tls.recv(len(MAGIC)) == MAGIC
            with pytest.raises((ssl.SSLError, OSError)):  # a certificate of another CA is refused
                with client_ssl_context(other).wrap_socket(socket.create_connection((host, port), timeout=5)) as s:
                    s.recv(len(MAGIC))
        finally:
            group.stop_renewing()
            group.close_data_plane()
            conn.client.cancel(group.futures, force=True)


def test_embedded_workers_drop_only_the_shutdown_heartbeat_error():
    """The preload's filter drops the heartbeat failure Dask logs when the embedded scheduler (in
    the chief's process) goes away during shutdown, and keeps every other worker error."""
    import logging

    from dtrain.deploy.preload import _QuietHeartbeat

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, msg, None, None)

    f = _QuietHeartbeat()
    assert not f.filter(record("Failed to communicate with scheduler during heartbeat."))
    assert f.filter(record("Unexpected exception during heartbeat. Closing worker."))
    assert f.filter(record("Compute Failed"))


def test_cluster_tls_false_gives_a_plain_tcp_cluster_and_data_plane():
    """``cluster.tls: false``: the embedded scheduler and workers speak plain TCP on 127.0.0.1, and
    so does the data plane (its greeting comes in the clear); with a scheduler the key is refused."""
    import socket

    import torch

    from dtrain.chief.ps_shards import ShardGroup
    from dtrain.dataplane.protocol import MAGIC
    from dtrain.deploy.cluster import ConnectError

    spec = dtrain.load(DIGITS, overrides=["cluster.tls=false"])
    with connect(spec, processes=False) as conn, conn.client.as_current():
        assert conn.client.scheduler.address.startswith("tcp://127.0.0.1:")
        assert all(w.startswith("tcp://127.0.0.1:") for w in conn.workers())
        plan = dtrain.compile(spec)
        group = ShardGroup(conn, spec, plan, token="plain")
        try:
            group.create([torch.zeros(s.numel) for s in plan.shards])
            assert group.data_plane["tls"] is None
            host, port = group.data_plane["endpoints"][0]
            with socket.create_connection((host, port), timeout=5) as raw:
                assert raw.recv(len(MAGIC), socket.MSG_WAITALL) == MAGIC  # no TLS hello needed
        finally:
            group.stop_renewing()
            group.close_data_plane()
            conn.client.cancel(group.futures, force=True)
    with pytest.raises(dtrain.SpecError, match="cluster.tls"):
        dtrain.load(DIGITS, overrides=["cluster.tls=false", "cluster.scheduler=tcp://127.0.0.1:1"])
    with pytest.raises(ConnectError, match="cluster.tls"), connect(spec, scheduler="tcp://127.0.0.1:1"):
        pass
