"""`kvjax serve`: an OpenAI-compatible HTTP server over `kvjax.Engine` (`app`), so that the `openai`
client, lm-evaluation-harness and chat front-ends run on compressed caches. Its rooms: `protocol` (the
API's fields and shapes), `worker` (the engine's own thread), `metrics` (Prometheus), `app` (the
Starlette routes). Needs the `serve` extra (starlette, uvicorn, prometheus-client)."""
