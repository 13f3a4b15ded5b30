"""Many sequences at once: the batching scheduler (scheduler.py) over a paged KV pool
(kv_pool.py), batch files (batch_input.py), and `minillm serve`: OpenAI's API over the scheduler
(app.py: HTTP; protocol.py: the request and answer shapes; metrics.py: /metrics). Nothing is
imported here: the engine's Model.scheduler imports the scheduler alone."""
