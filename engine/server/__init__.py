"""The server (floor 3): OpenAI's chat and completions API over one engine thread.

What lives here: host.py (the job queue, generation jobs, the `Host` and `Models` seams; the
engine thread's models are an engine.runtime.pool.ModelPool) and api.py (Starlette routes,
request validation, streaming; Starlette and uvicorn load only when serving). May import the
runtime, the KV layer, the library and the leaves; never the importers, quant, bench or app.
"""
