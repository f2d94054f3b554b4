"""Model repository builder and the BLS orchestrator model."""
