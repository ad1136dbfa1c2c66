"""rlfleet: reinforcement-learning fine-tuning of robot policies as gRPC microservices.

This package holds what every service shares: the generated protobuf modules (``rlfleet.v1``), the tensor codec,
configuration, gRPC helpers and the policy models (one implementation serves inference and learner).
"""

import os as _os

# gRPC's C core logs an INFO line each time a process with gRPC threads forks a child (the coordinator does);
# keep only errors unless the user asks for more.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

__version__ = "0.1.0"
