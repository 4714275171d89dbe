"""trainguard: watch RL post-training runs as streams, alert, and close the loop."""

__version__ = "0.1.0"
