"""Serving: requests in, tokens out, over the same draft-and-verify round as eval.

    scheduler.py      the engine thread: slots of the static cache that requests join and leave
                      between rounds (continuous batching), adaptive k, the serve counters
    openai_server.py  the OpenAI-compatible HTTP app (FastAPI): completions and chat, streaming, limits
    protocol.py       its request bodies, the fields refused or ignored, errors in OpenAI's shape
    http.py           the engine process and the HTTP front process (uvicorn around the app): serve
                      until Ctrl-C / SIGTERM, drain, stop
    link.py           the pipe between them: submits and cancels one way, a pass's token events the other
    metrics.py        /metrics in the Prometheus text format, from a snapshot of the scheduler's counters
    detokenize.py     incremental detokenization with stop strings (what a stream may send so far)

The `serve` stage (stages/serve.py) builds these over the loaded target, draft and graphs.
"""
