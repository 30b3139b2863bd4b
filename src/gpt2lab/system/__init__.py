"""Layer 0: errors and exit codes, atomic files, machine facts and auto choices, setting names, the hardware table, run-directory ownership and lock."""
