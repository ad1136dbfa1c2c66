"""The per-call cost of the run's credentials on the serving side (issue 33).

    python benchmarks/auth_cost.py [--calls 20000]

Measures rlfleet.wire.callers.check_caller, what every served call runs on the server's polling thread before it waits
for a thread: (1) the same caller again and again (a service's calls: its bearer is the same on every call), (2) a
bearer this server has not seen yet (first call of each caller, or a flood of made-up-but-well-formed bearers), (3)
a garbage bearer (refused), and (4) a unary call over loopback gRPC with and without the check (Status of a
minimal servicer), each as microseconds per call. One thread, as the polling thread is."""

from __future__ import annotations

import argparse
import statistics
import time


def per_call_us(fn, n: int, repeats: int = 5) -> float:
    """The median over ``repeats`` of the mean time of ``n`` calls of ``fn(i)``, in microseconds."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main(argv=None) -> int:
    import torch

    torch.set_num_threads(1)
    from rlfleet.errors import AuthError
    from rlfleet.wire import auth, callers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args(argv)
    secret = auth.new_token()
    method = "/rlfleet.v1.LearnerService/PushRollout"
    auth.set_identity("learner", auth.issue(secret, "learner", 0), 0)
    same = auth.metadata(secret, "env", 3, to="learner")
    n_fresh = min(args.calls, 2000)
    fresh = [auth.metadata(secret, "env", i, to="learner") for i in range(n_fresh)]  # a cert each
    role_wide = auth.issue(secret, "env")  # one cert, a bearer per index
    same_cert = [auth.metadata(role_wide, "env", i, to="learner") for i in range(n_fresh)]
    garbage = [(k, "Bearer " + "x" * 43 if k == callers.TOKEN_KEY else v) for k, v in same]

    def refused(i):
        try:
            callers.check_caller(method, garbage)
        except AuthError:
            pass

    results = {
        "same caller (every call of a service)": per_call_us(lambda i: callers.check_caller(method, same), args.calls),
        "a caller not seen before": per_call_us(lambda i: callers.check_caller(method, fresh[i]), n_fresh, repeats=1),
        "a known cert, a new index (role-wide)": per_call_us(
            lambda i: callers.check_caller(method, same_cert[i]), n_fresh, repeats=1
        ),
        "garbage bearer (refused)": per_call_us(refused, args.calls),
    }
    results.update(grpc_round_trip(secret, min(args.calls, 3000)))
    for what, us in results.items():
        print(f"{what:45s} {us:9.1f} us/call")
    auth.set_identity("learner", None)
    return 0


def grpc_round_trip(secret: str, n: int) -> dict[str, float]:
    """Unary LearnerService.Status over loopback: with the run's credentials (checked) and without (none)."""
    from rlfleet.v1 import learner_pb2, learner_pb2_grpc
    from rlfleet.wire import auth, channels, servers

    class Servicer(learner_pb2_grpc.LearnerServiceServicer):
        def Status(self, request, context):
            return learner_pb2.LearnerStatus()

    out = {}
    for label, token in (("loopback unary call, checked", secret), ("loopback unary call, no credentials", None)):
        auth.set_identity("learner", auth.issue(secret, "learner", 0) if token else None, 0)
        server = servers.make_server(max_workers=2)
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(Servicer(), server)
        address = servers.bind(server, "127.0.0.1:0")
        server.start()
        try:
            md = auth.metadata(secret, "coordinator", 0, to="learner") if token else ()
            with channels.channel(address, credential=False) as ch:
                stub = learner_pb2_grpc.LearnerServiceStub(ch)
                for _ in range(200):  # warm up
                    stub.Status(learner_pb2.LearnerStatusRequest(), metadata=md, timeout=5)
                out[label] = per_call_us(
                    lambda i: stub.Status(learner_pb2.LearnerStatusRequest(), metadata=md, timeout=5), n, repeats=3
                )
        finally:
            server.stop(0)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
