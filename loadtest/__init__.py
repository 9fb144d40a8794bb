"""Load tests (Locust), their reports, and the multi-node autoscaling demonstration."""
