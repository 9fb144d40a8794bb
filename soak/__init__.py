"""The soak (``scripts/soak``, ``python -m soak.run``): mixed load with disconnects, bad requests,
overload bursts and one replica crash (``run.py``); what it sends (``payloads.py``) and each
replica's memory through the run (``memory.py``)."""
