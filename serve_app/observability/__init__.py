"""What the service tells operators: Prometheus metrics and the replicas' logs."""
