"""Delivery guarantees: leases, the write fence, dead letters, exactly once; partial rollout and staleness."""
