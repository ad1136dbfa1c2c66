"""rlfleet: reinforcement-learning fine-tuning of robot policies as gRPC microservices.

This package holds what the services share, by layer; a layer imports only the layers before it (checked by
tests/test_layers.py; docs/architecture.md draws it):

0. ``rlfleet.registry``: the lookup every registry uses, and ``rlfleet.errors``: the typed errors the cores raise
   (both import nothing of rlfleet);
1. ``rlfleet.wire`` (with the generated ``rlfleet.v1``): codec, spaces, servers and channels (and what every call
   passes through: callers, status, streams, tls), auth, tracing, the service runtime,
   each service's client, the rollout schema and the env contract;
2. ``rlfleet.data``: datasets, videos, metrics, intervals;
3. ``rlfleet.simulators``: the simulator registry (data only), their Python environments, the conformance kit;
4. ``rlfleet.policies``: the policy and inference-backend registries, the policy interface, the model families,
   the memory footprint;
5. ``rlfleet.config``: run configuration validated against every registry, placement, and whether a run fits.

The services (``services/*``) import rlfleet, never each other.
"""

import os as _os

# gRPC's C core logs an INFO line each time a process with gRPC threads forks a child (the coordinator does);
# keep only errors unless the user asks for more.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

__version__ = "0.1.0"
