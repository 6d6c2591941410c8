"""nanospec's OpenAI-compatible HTTP server (``nanospec-serve``, ``python -m nanospec.serve``). A front end:
the engine never imports this package, and it imports no benchmark."""
