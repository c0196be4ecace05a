"""The training loop and the guards around each step."""
