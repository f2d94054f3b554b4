"""Fold network export (TorchScript) and the Python-backend fold runner."""
