"""Layer 6: metrics, W&B, plots, run comparison, reports."""
