"""Layer 5: weights in and out: Hugging Face conversion, hub and export (hf), --model arguments (load)."""
