"""A local OpenAI-compatible HTTP server over the engine (`strata serve`).

Contract: `host` is the engine side (one thread owns MLX and runs queued jobs in FIFO order;
no HTTP here); `api` is the HTTP side (Starlette on uvicorn), imported only when a server
starts, so that neither the CLI nor the app pays for it at start-up.
"""
