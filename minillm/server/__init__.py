"""`minillm serve`: OpenAI's API over the batching scheduler (app.py: HTTP; protocol.py: the
request and answer shapes; metrics.py: /metrics), and client.py, which the CLI's --server uses.
Nothing is imported here: the client must not pull in the server's packages."""
