"""supervisord-gpu: own SGLang servers and routers through cgroups, start them only on idle GPUs."""

__version__ = "0.1.0"
