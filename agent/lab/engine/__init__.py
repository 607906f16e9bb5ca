"""The kvwatch reference engine: a small torch inference engine with a paged KV cache,
continuous batching, an OpenAI-compatible streaming API and two egress modes.

The only package of kvwatch that imports torch. This file imports nothing, so that
`kvwatch.lab.engine.config` stays light for the CLI. Where things are:
- `kvwatch.lab.engine.engine.Engine` (with `kvwatch.lab.engine.config.EngineConfig`):
  submit, cancel, park, pause, release, abort, stats, request reports;
  `kvwatch.lab.engine.requests` holds what goes in and out.
- `kvwatch.lab.engine.engine_server.EngineServer`: the engine over HTTP (uvicorn), hook attached.
- `kvwatch.lab.engine.app.build_app`: the ASGI app alone.
"""
