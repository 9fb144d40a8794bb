"""The MiniCPM-o engine alone (no Ray): levels of streams, their TTFB and real time, the step
log; the engine -> replica hop (wire); roofline and projection onto another GPU."""
