"""nanospec's tools around the engine: assistant training (``train``), acceptance evaluation (``eval``), the
benchmark (``bench``), the data they read (``datasets``), their argument checks (``cli``) and the offline
bundle (``bundle``). The engine never imports them."""
