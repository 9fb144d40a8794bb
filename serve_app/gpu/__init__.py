"""The GPU deployment: the Synthesizer replica, the engine process it hosts and the wire
between them, its request routing and its autoscaling policy."""
