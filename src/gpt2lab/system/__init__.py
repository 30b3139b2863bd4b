"""Layer 0: errors and exit codes, atomic files, format versions, machine facts and auto choices, setting
names, the hardware table, run-directory ownership and lock."""
