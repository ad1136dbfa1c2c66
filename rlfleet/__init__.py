"""rlfleet: reinforcement-learning fine-tuning of robot policies as gRPC microservices.

This package holds what every service shares: the generated protobuf modules (``rlfleet.v1``), the tensor codec,
configuration, gRPC helpers and the policy models (one implementation serves inference and learner).
"""

__version__ = "0.1.0"
