"""The network: ``config`` (GPTConfig, the architecture's one definition, torch-free),
``gpt`` (the GPT module), ``loss`` (the chunked training loss). No I/O here."""
