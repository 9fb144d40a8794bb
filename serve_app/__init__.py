"""MiniCPM-o 2.6 text-to-speech served on Ray Serve: text in, streamed speech out."""

__version__ = "0.1.0"
