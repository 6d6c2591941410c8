"""nanospec's OpenAI-compatible HTTP server (``nanospec-serve``, ``python -m nanospec.serve``) and the serving
benchmark's client. A front end: the engine never imports this package."""
