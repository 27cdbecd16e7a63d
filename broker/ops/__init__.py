"""Running the broker as a service: the ``broker`` command, its live view, the Prometheus exporter, ACL rules
and the local redis-servers the tests, demos and benchmark start."""
