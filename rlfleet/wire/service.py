"""What every service process does around its core: serve gRPC, register with the coordinator, heartbeat, and
exit cleanly when told to or when the coordinator is gone (no orphan processes)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import uuid

import grpc

from rlfleet.v1 import coordinator_pb2, coordinator_pb2_grpc
from rlfleet.wire import channels

log = logging.getLogger("rlfleet.wire.service")

ROLES = {"env": coordinator_pb2.ENV, "inference": coordinator_pb2.INFERENCE, "learner": coordinator_pb2.LEARNER}


def common_args(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True, help="resolved run config (YAML) written by the coordinator")
    p.add_argument("--address", default="127.0.0.1:0", help="host:port to serve on (port 0 = any free port)")
    p.add_argument("--index", type=int, default=0, help="index of this service among its role")
    p.add_argument("--coordinator", default=None, help="coordinator address to register with (optional)")
    p.add_argument(
        "--advertise",
        default=None,
        help="address other services use to reach this one, if not the bound one (e.g. env:50061 in compose)",
    )
    p.add_argument("--log-level", default=os.environ.get("RLFLEET_LOG_LEVEL", "WARNING"))
    return p


PARENT_PID_ENV = "RLFLEET_PARENT_PID"  # pid of the process that started this one (a local launcher's coordinator)


def die_with_parent() -> None:
    """When started by a coordinator (RLFLEET_PARENT_PID), exit as soon as it dies, even by kill -9.

    RLFLEET_PARENT_PID is the pid of the process that started this one. A learner rank is started by torchrun's
    agent, not by the coordinator: the local launcher runs that agent through ``rlfleet.wire.torchrun``, which binds
    itself to the coordinator here and then sets RLFLEET_PARENT_PID to its own pid for the ranks it starts, so
    each rank binds to its real parent (the agent) and a chain coordinator -> agent -> ranks ends as one."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != int(parent):  # the parent died before we got here
        os._exit(1)


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun's agent started (it sets TORCHELASTIC_RUN_ID for its ranks)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launched_pid() -> int:
    """The pid of the process a launcher started for this service, which the coordinator watches: this process,
    or for a rank under torchrun the agent that started it (its parent), whose exit is the group's."""
    return os.getppid() if under_torchrun() else os.getpid()


CPU_CORES_ENV = "RLFLEET_CPU_CORES"  # comma-separated CPU cores a local launcher placed this process on


def pin_to_placed_cores() -> None:
    """Run on the cores the launcher placed this process on (cluster.cpu_placement), if it said."""
    cores = os.environ.get(CPU_CORES_ENV, "").strip()
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})


CANNOT_START = 3  # exit code of a service that failed before serving (config, simulator, import): no restart


def exit_after(main) -> None:
    """Run a service's main and leave at once: handler threads still blocked on a dead peer must not hold the
    process (ThreadPoolExecutor joins its workers at interpreter exit). A failure that escapes ``main`` happened
    before the service served anything (config, missing package, simulator): exit CANNOT_START, which the
    coordinator does not restart."""
    import sys
    import traceback

    try:
        code = main()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = CANNOT_START
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        code = CANNOT_START
    from rlfleet.wire import tracing

    tracing.shutdown()  # flush spans and metrics: os._exit skips atexit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def pick_device() -> str:
    """'cuda' when this process was placed on a GPU (CUDA_VISIBLE_DEVICES) and torch sees it, else 'cpu'."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def setup_process(args, cfg, role: str) -> None:
    """Logging, threads, the run credential and telemetry of a service process (before it serves)."""
    from rlfleet.wire import auth, tracing

    die_with_parent()
    pin_to_placed_cores()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s[%(process)d] %(message)s")
    token = auth.token_from_env()
    if args.coordinator and not token:
        raise SystemExit(
            f"rlfleet {role}[{args.index}]: no run credential: set {auth.TOKEN_ENV} to this service's "
            f"credential (`python -m rlfleet.wire.auth issue --role {role}`; coordinatorctl start and deploy "
            f"hand one to each service) or to the run's secret"
        )
    try:
        ident = auth.set_identity(role, token, args.index)
    except auth.CredentialError as exc:
        raise SystemExit(f"rlfleet {role}[{args.index}]: {exc}") from None
    if ident is not None and ident.from_secret:
        print(
            f"rlfleet {role}[{args.index}]: note: {auth.TOKEN_ENV} holds the run secret, from which every role's "
            f"credential can be made; give this service only its own (`python -m rlfleet.wire.auth issue --role "
            f"{role}`, what coordinatorctl start and deploy do)",
            file=sys.stderr,
            flush=True,
        )
    from rlfleet.wire import tls

    tls.configure_tls(cfg.cluster.tls)
    # part of a run: traces next to its config (the run folder) unless RLFLEET_TRACE_DIR says; a standalone server
    # (no coordinator) exports only where RLFLEET_TRACE_DIR or an OTLP endpoint says
    tracing.setup(role, args.index, cfg, os.path.dirname(os.path.abspath(args.config)) if args.coordinator else None)
    try:  # env servers run in simulator environments that may have no torch
        import torch
    except ImportError:
        return
    torch.set_num_threads(max(1, int(cfg.cluster.torch_num_threads)))


class ServiceRuntime:
    """Serve, register, heartbeat; ``wait()`` blocks until shutdown (signal, coordinator says so, or it is gone)."""

    SLOW_COORDINATOR_FACTOR = 4  # heartbeats that time out (not refused): leave after this many heartbeat timeouts

    def __init__(
        self,
        role: str,
        index: int,
        server: grpc.Server,
        address: str,
        coordinator: str | None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 15.0,
        config_yaml: str = "",
    ):
        self.role, self.index, self.server, self.address = role, index, server, address
        self.coordinator = coordinator
        self.incarnation = uuid.uuid4().hex[:12]
        self.interval, self.timeout = heartbeat_interval_s, heartbeat_timeout_s
        self.stop_event = threading.Event()
        self.config_yaml = config_yaml
        self.exit_code = 0

    def serve_until_stopped(self, cfg, args) -> int:
        """Register (with the config, for the coordinator to compare), heartbeat, block; -> exit code."""
        from omegaconf import OmegaConf

        self.config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        self.run(args.advertise)
        return self.exit_code

    def run(self, advertise: str | None = None) -> None:
        if advertise:
            self.address = advertise
        # A signal handler must take no lock: it runs on the main thread between bytecodes, possibly while that
        # thread holds the very lock (Event.set inside Event.wait deadlocks). Signals come in bursts: a killed
        # coordinator's PR_SET_PDEATHSIG is sent again each time the child is handed to another of its dying threads.
        signalled: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, _frame: signalled.append(signum))
        signal.signal(signal.SIGINT, lambda signum, _frame: signalled.append(signum))
        print(f"rlfleet {self.role}[{self.index}] serving on {self.address} (pid {os.getpid()})", flush=True)
        if self.coordinator:
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        while not signalled and not self.stop_event.wait(0.2):
            pass
        self.stop_event.set()  # the heartbeat thread stops too
        self.server.stop(grace=1.0).wait(2.0)

    def _heartbeat_loop(self) -> None:
        ch = channels.channel(self.coordinator)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        role = ROLES[self.role]
        registered, last_ok = False, time.monotonic()
        while not self.stop_event.is_set():
            try:
                if not registered:
                    try:
                        stub.Register(
                            coordinator_pb2.RegisterRequest(
                                role=role,
                                index=self.index,
                                address=self.address,
                                pid=launched_pid(),
                                incarnation=self.incarnation,
                                config_yaml=self.config_yaml,
                            ),
                            timeout=5,
                        )
                    except grpc.RpcError as exc:
                        if exc.code() in (
                            grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.UNAUTHENTICATED,
                            grpc.StatusCode.PERMISSION_DENIED,
                        ):
                            print(
                                f"rlfleet {self.role}[{self.index}]: the coordinator refused this service: "
                                f"{exc.details()}",
                                flush=True,
                            )
                            self.exit_code = 2
                            self.stop_event.set()
                            return
                        raise
                    registered = True
                reply = stub.Heartbeat(
                    coordinator_pb2.HeartbeatRequest(role=role, index=self.index, incarnation=self.incarnation),
                    timeout=5,
                )
                last_ok = time.monotonic()
                if reply.shutdown:
                    log.info("coordinator asked to shut down")
                    self.stop_event.set()
                    return
            except grpc.RpcError as exc:
                # before the first registration, wait longer: the coordinator may start after us (compose); a
                # coordinator that takes the call but answers late is slow, not gone: it hears us (it notes a
                # heartbeat when the call arrives), so give it longer before leaving the run
                limit = self.timeout if registered else max(self.timeout, 120.0)
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    limit = max(limit, self.SLOW_COORDINATOR_FACTOR * self.timeout)
                if time.monotonic() - last_ok > limit:
                    print(
                        f"rlfleet {self.role}[{self.index}]: coordinator {self.coordinator} unreachable for "
                        f"{time.monotonic() - last_ok:.0f}s ({channels.describe_error(exc)}); shutting down",
                        flush=True,
                    )
                    self.stop_event.set()
                    return
            self.stop_event.wait(self.interval)
