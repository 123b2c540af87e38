"""The SGLang rollout backend, whole: the client of one server's native API (`client.py`), the server processes
(`servers.py`), the router over N of them (`router.py`), how weights reach them (`weights.py`) and the producer the
loop drives (`producer.py`, registered as the built-in `rollout.engine: sglang`)."""
