"""Text in and out: tokenizers (`tokenizer`) and chat templates (`chat`)."""
