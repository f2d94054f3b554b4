"""Developer tools run from the checkout root (``python -m tools.<name>`` or ``python tools/<name>.py``)."""
