"""MiniCPM-o 2.6's speech model: its modules (modeling, layers, the audio codec, the reference-clip
encoder), reading and quantizing its weights (loader, gptq, quantization), and a synthetic
checkpoint for tests. Plain modules over tensors; no scheduling, no streams."""
