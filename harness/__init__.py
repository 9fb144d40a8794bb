"""What the measuring runs and the tests stand on: the app as users run it on a fresh local Ray
(``service.py``), ports and processes of a run of its own on a shared machine
(``local_ray.py``), and one speech stream over each way the service streams
(``stream_clients.py``)."""
