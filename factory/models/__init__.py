"""Policy models and tokenizers built from configs, and HF-format checkpoints."""
