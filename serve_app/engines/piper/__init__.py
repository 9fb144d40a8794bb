"""The Piper engine: a small CPU voice (ONNX) behind the same contract as MiniCPM-o
(:mod:`serve_app.engines.base`)."""
