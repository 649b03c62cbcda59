"""The D-Bus skin: a thin layer that authorizes callers and calls the engine."""
