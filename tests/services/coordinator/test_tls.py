"""Mutual TLS on every gRPC connection of a run (cluster.tls), with certificates made by openssl here."""

import json
import shutil
import subprocess

import grpc
import pytest

from rlfleet.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.services.coordinator.test_end_to_end import CTL, finish, start

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificates"),
]


def make_certs(d):
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=rlfleet test CA",
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "host.key", "-out", "host.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "x509",
        "-req",
        "-in",
        "host.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "host.pem",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    )
    return [
        f"cluster.tls.cert_file={d / 'host.pem'}",
        f"cluster.tls.key_file={d / 'host.key'}",
        f"cluster.tls.ca_file={d / 'ca.pem'}",
        "cluster.tls.client_auth=true",
    ]


def test_a_run_over_mutual_tls_and_plaintext_is_refused(tmp_path):
    certs = make_certs(tmp_path)
    # a run with no end of its own, stopped over TLS below: a short one could end between two status polls
    proc = start(tmp_path, "runner.max_epochs=100000", "runner.val_check_interval=0", *certs, name="tls")
    run = tmp_path / "tls"
    try:
        # wait_epoch's status helper dials plaintext: use coordinatorctl status (it reads the run's TLS config)
        import time

        end = time.monotonic() + 120
        while time.monotonic() < end:
            out = subprocess.run([*CTL, "status", str(run)], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and "epoch" in out.stdout and "tls: training" in out.stdout:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"coordinatorctl status over TLS never answered: {out.stdout}{out.stderr}")
        address = json.loads((run / "coordinator.json").read_text())["address"]
        with grpc.insecure_channel(address) as ch:  # plaintext to a TLS server: no connection at all
            with pytest.raises(grpc.RpcError) as err:
                coordinator_pb2_grpc.CoordinatorServiceStub(ch).Status(coordinator_pb2.StatusRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        stop = subprocess.run([*CTL, "stop", str(run)], capture_output=True, text=True, timeout=30)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "stop requested" in stop.stdout, stop.stdout
        code, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, out
    assert "coordinatorctl stop" in out, out[-3000:]
