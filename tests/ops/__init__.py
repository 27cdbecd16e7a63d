"""Operations: the CLI, watch, the exporter, metrics, security, the redis-server launcher, docker/."""
