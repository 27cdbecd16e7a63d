"""Redis Cluster: the sharded store, slot moves, replication and failovers, the local cluster."""
