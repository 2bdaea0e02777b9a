"""Stand-in: SGLang imports IPython.display at module import only."""
