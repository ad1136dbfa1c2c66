"""Layer 2, data on disk (datasets, videos, metrics, intervals): imports rlfleet.registry and rlfleet.wire only."""
