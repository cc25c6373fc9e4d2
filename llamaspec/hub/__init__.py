"""Named pairs: models.toml (shipped and the user's own), resolved to local files through the Hugging Face cache.
Library code only: it never prompts (the CLI asks before a download and passes `assume_yes`)."""
