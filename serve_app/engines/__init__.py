"""Speech engines: plain Python libraries with no Ray import.

The same engine runs under Ray Serve (the synthesizer deployment), in benchmark scripts on a
bare GPU and in unit tests. Every engine honours the contract in :mod:`serve_app.engines.base`.
"""
