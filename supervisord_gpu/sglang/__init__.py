"""What we know about SGLang 0.5.23 and its routers (sglang-router 0.3.2, smg 1.13.0), in one place.

Production (the engine, the config loader, preflight) and the rehearsal stand-ins both import
from here; nothing here imports the stand-ins. Each module is one kind of fact:
options (the command line), routers (one table per router: module, title, options, stop
timing, worker-API quirks), flags (validating a rendered command line), logs (start-up phases
and how to classify a line), read from SGLang's source (shared/reference/sglang-server.md).
"""
