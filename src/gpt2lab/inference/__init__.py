"""Layer 6: sampling (generate) and text in, text out (completion)."""
