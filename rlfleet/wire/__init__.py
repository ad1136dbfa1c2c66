"""Layer 1, the wire and the service runtime (codec, spaces, rpc, auth, tracing, clients, rollout schema, env
contract): imports rlfleet.registry and rlfleet.v1 only."""
