"""Layer 1, the wire and the service runtime (codec: tensors, the rollout schema, the policy's output and its noise
keys; spaces; servers, channels, callers, status, streams, tls; auth, tracing, clients, env contract): imports
rlfleet.registry, rlfleet.errors and rlfleet.v1 only."""
