"""The model families (architectures); policies are built through the registry in rlfleet.policies."""
