"""Layer 7: the run's settings (config), its plan (plan), start-up (run), the trainer and its parts."""
