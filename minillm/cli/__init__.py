"""The command line (`minillm`, app.py), the terminal chat (repl.py) and the benchmark drivers
(bench*.py, benchmarks.py, gpu_check.py). Built on the engine; the engine never imports it."""
