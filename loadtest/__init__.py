"""Locust: users that stream speech and measure what a listener feels (``locustfile.py``), a
bounded headless run with its report (``run.py``, ``report.py``; ``scripts/loadtest``), and what
they send and read (``corpus.py``, ``audio_bytes.py``, ``sse_audio.py``)."""
