"""Coordinator gRPC server: translates CoordinatorService calls to the Coordinator core."""

from __future__ import annotations

from rlfleet.errors import InvalidRequest
from rlfleet.v1 import coordinator_pb2, coordinator_pb2_grpc
from rlfleet.wire import callers, servers, status

MAX_REQUEST_BYTES = 4 << 20  # a Register carries a config of a few kB; nothing else is big
MAX_STOP_REASON = 1000


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, coordinator):
        self.coord = coordinator

    @status.handler
    def Register(self, request, context):
        ok = self.coord.register(
            request.role,
            request.index,
            request.address,
            request.pid,
            request.incarnation,
            request.config_yaml,
            caller=callers.caller_of(context),
        )
        return coordinator_pb2.RegisterResponse(accepted=ok)

    @status.handler
    def Heartbeat(self, request, context):
        return coordinator_pb2.HeartbeatResponse(
            shutdown=self.coord.heartbeat(
                request.role, request.index, request.incarnation, caller=callers.caller_of(context)
            )
        )

    @status.handler
    def Status(self, request, context):
        return self.coord.status()

    @status.handler
    def Scale(self, request, context):
        previous, message = self.coord.request_scale(request.role, request.count)
        return coordinator_pb2.ScaleResponse(previous=previous, count=request.count, message=message)

    @status.handler
    def Stop(self, request, context):
        if len(request.reason) > MAX_STOP_REASON:
            raise InvalidRequest(f"reason: {len(request.reason)} characters; at most {MAX_STOP_REASON}")
        self.coord.request_stop(request.reason or "coordinatorctl stop")
        return coordinator_pb2.StopResponse(stopping=True)


def serve(coordinator, address: str):
    # heartbeats are noted as they arrive (servers.make_server's on_call, before they wait for a thread): a coordinator
    # busy answering never takes a live service for a dead one
    server = servers.make_server(max_workers=32, max_receive_bytes=MAX_REQUEST_BYTES, on_call=coordinator.heard)
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(CoordinatorServicer(coordinator), server)
    servers.add_health_and_reflection(server, servers.service_name(coordinator_pb2, "CoordinatorService"))
    bound = servers.bind(server, address)
    server.start()
    coordinator.address = bound
    return server
