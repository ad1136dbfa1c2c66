"""``python -m rlfleet.wire.healthcheck HOST:PORT [SERVICE]``: a grpc.health.v1 probe (compose healthchecks, scripts).

Exits 0 when the server answers SERVING (for SERVICE, or for the whole server when omitted), 1 otherwise,
printing what it got. Health checks need no run credential."""

from __future__ import annotations

import sys


def check(address: str, service: str = "", timeout: float = 5.0) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            return False, f"{address}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address} {service or '(server)'}: {status}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    ok, text = check(argv[0], argv[1] if len(argv) > 1 else "")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
