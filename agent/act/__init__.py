"""Stage 4, actions: cancel a stalled request through the engine hook, or reset its socket."""
