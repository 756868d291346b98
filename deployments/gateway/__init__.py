"""The gateway: the OpenAI-compatible front door to every serving copy of every cluster.

A process of its own (``config/gateway_asgi.py``, started by ``faden serve`` on FADEN_GATEWAY_PORT),
not Django's request stack: a plain ASGI application under uvicorn that holds its routes and keys in
memory and forwards each request to the copy with the fewest requests in flight, or to the one holding
the prompt's prefix in its cache (``app.py``). The modules, each for one thing:

- ``keys.py``: what a key looks like and how it is hashed (the console's services and the gateway alike);
- ``routes.py``: the route and key tables, read from the database in a thread every half second, and
  the choice of a copy;
- ``prefix.py``: cache-aware routing, the prefix index (which copy served a prompt's prefix lately);
- ``traffic.py``: requests, errors and latency per deployment, counted in memory and added up in Redis
  every second; ``traffic()`` is what the pages read;
- ``failures.py``: a copy that refused a connection, reported on a Redis list the console's health
  check reads;
- ``limits.py``: the keys' limits a minute, decided in memory, the counts shared through Redis every second;
- ``key_usage.py``: what each key used per hour (requests, errors, refusals, the answers' tokens), added up
  in Redis for the console to copy to the database;
- ``upstream.py``: keep-alive connections to the copies (asyncio and httptools' parser);
- ``metrics.py``: ``GET /metrics`` in Prometheus's text format, counted in memory on the request path;
  ``metrics_files.py`` adds up the figures of workers sharing a port (prometheus_client's multiprocess files);
- ``protocol.py``: uvicorn's HTTP protocol with bounds, one write per answer, and the request's ``Client``
  (its hang-up cancels the request);
- ``app.py``: the ASGI application.

Only ``keys``, ``traffic``, ``failures`` and ``key_usage`` are imported by the console's own processes: the others
run on the gateway's event loop. docs/gateway.md is the operator's and the client's view.
"""
