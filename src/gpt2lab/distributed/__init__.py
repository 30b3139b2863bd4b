"""Layer 3: process groups and collectives (dist), DDP/FSDP2 wrapping (parallel)."""
