"""The typed errors rlfleet's cores raise, the lowest layer (imports nothing: no gRPC, no numpy, no torch).

A core (the learner, the inference engine, the rollout worker, the vec env, the coordinator) raises these; a
service's gRPC face turns each into its status code in one place, :mod:`rlfleet.wire.status`, and a client turns
a status code back into the same type there. The base classes are part of the contract: ``except ValueError``
catches an :class:`InvalidRequest`, ``except RuntimeError`` the others."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that is well-formed protobuf but wrong for this service (unknown id, wrong size...)."""


class FailedPrecondition(RuntimeError):
    """A request that cannot be served in the service's current state."""


class PermissionDenied(RuntimeError):
    """A proven caller asking for something its role or index may not do (e.g. registering as another service)."""


class ResourceExhausted(RuntimeError):
    """The service is at a limit it declares (e.g. concurrent streams); retry later or close something first."""


class Unavailable(RuntimeError):
    """The service is up but cannot serve this now (a part it needs is being rebuilt); retry shortly."""


class Cancelled(RuntimeError):
    """The work stopped early because the caller went away or its deadline was about to pass."""


class AuthError(RuntimeError):
    """A call without a valid credential (args: 'UNAUTHENTICATED', message), or from a role that does not own
    the method or with another role's credential ('PERMISSION_DENIED', message)."""
